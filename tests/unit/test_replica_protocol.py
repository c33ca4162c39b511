"""The peer replica's protocol core (ftagent/checkpoint/replica_protocol.py): pure, no I/O.

A handshake either side of which lacks the job's key, a foreign, stale or oversized offer,
a torn, corrupt or altered stream: each refused with its reason, nothing said ``done``.
"""

from __future__ import annotations

import zlib

import pytest

from ftagent.checkpoint import layout
from ftagent.checkpoint import replica_protocol as rp

JOB = "job-a"
KEY = rp.replica_key("job-token", JOB)
CN, SN = "a" * 32, "b" * 32
FILES = {".metadata": b"meta" * 10, "__0_0.distcp": bytes(range(256)) * 40, "empty": b""}


def _marker(job: str = JOB, rank: int = 1, step: int = 7, files: dict[str, bytes] = FILES,
            world: int = 2) -> layout.Marker:
    return layout.Marker(job, rank, world, step,
                         {n: [len(b), zlib.crc32(b)] for n, b in files.items()},
                         {"model.w": "tensor:float32:[4]"}, 1.0)


def _stream(marker: layout.Marker, files: dict[str, bytes] = FILES,
            key: bytes = KEY) -> tuple[bytes, bytes]:
    """The offer line and the bytes after it, as a sender makes them."""
    t = rp.Transcript(key, CN, SN)
    line = rp.offer(marker)
    t.update(line)
    body = b"".join(files[n] for n in sorted(marker.files))
    t.update(body)
    return line, body + t.digest()


def _receive(line: bytes, rest: bytes, limits: rp.Limits, piece: int = 7
             ) -> tuple[rp.Receiver, dict[str, bytearray]]:
    m = rp.parse_offer(line, limits)
    t = rp.Transcript(KEY, CN, SN)
    t.update(line)
    r = rp.Receiver(m, t)
    got: dict[str, bytearray] = {n: bytearray() for n in m.files}
    for i in range(0, len(rest), piece):  # in small, odd pieces
        for c in r.feed(rest[i:i + piece]):
            assert c.offset == len(got[c.name])
            got[c.name] += c.data
    return r, got


def test_handshake_proves_the_key_both_ways():
    h = rp.parse_hello(rp.hello(JOB, "push", CN), job=JOB)
    line = rp.challenge(KEY, h.nonce, SN)
    assert rp.check_challenge(line, KEY, CN) == SN
    rp.check_response(rp.response(KEY, CN, SN), KEY, CN, SN)


def test_a_peer_without_the_key_is_refused_either_way():
    other = rp.replica_key("another-token", JOB)
    with pytest.raises(rp.Refused, match="replica key"):
        rp.check_challenge(rp.challenge(other, CN, SN), KEY, CN)
    with pytest.raises(rp.Refused, match="replica key"):
        rp.check_response(rp.response(other, CN, SN), KEY, CN, SN)
    # a proof from another connection (other nonces) is not this one's
    with pytest.raises(rp.Refused, match="replica key"):
        rp.check_response(rp.response(KEY, CN, "c" * 32), KEY, CN, SN)
    # the key is per job: another job's token-derived key does not open this one
    assert rp.replica_key("job-token", "job-b") != KEY


@pytest.mark.parametrize("line,why", [
    (rp.hello("job-b", "push", CN), "job 'job-b'"),
    (rp.hello(JOB, "delete", CN), "not one"),
    (rp.hello(JOB, "push", "short"), "not one"),
    (rp.hello(JOB, "fetch", CN), "without a rank"),
    (b"[1]\n", "not an object"),
    (b"x" * (rp.MAX_LINE + 1), "too long"),
])
def test_bad_hellos_are_refused(line, why):
    with pytest.raises(rp.Refused, match=why):
        rp.parse_hello(line, job=JOB)


def test_a_shard_arrives_whole_and_checked():
    line, rest = _stream(_marker())
    r, got = _receive(line, rest, rp.Limits(JOB, {1}))
    assert r.done and {n: bytes(b) for n, b in got.items()} == FILES
    r.eof()


@pytest.mark.parametrize("marker,limits,why", [
    (_marker(job="job-b"), rp.Limits(JOB, {1}), "job 'job-b'"),
    (_marker(rank=0), rp.Limits(JOB, {1}), "rank 0"),
    (_marker(step=5), rp.Limits(JOB, {1}, held={1: 5}), "holds step 5"),
    (_marker(step=5), rp.Limits(JOB, {1}, step=6), "asked for step 6"),
    (_marker(), rp.Limits(JOB, {1}, max_bytes=100), "over this agent's replica cap"),
    (_marker(rank=3, world=2), rp.Limits(JOB, None), "not one"),
    (_marker(), rp.Limits(JOB, None, max_bytes=20000, other_bytes=15000), "held for other"),
])
def test_foreign_stale_or_oversized_offers_are_refused(marker, limits, why):
    with pytest.raises(rp.Refused, match=why):
        rp.parse_offer(rp.offer(marker), limits)


def test_an_offer_that_is_not_a_marker_is_refused():
    with pytest.raises(rp.Refused, match="not one ftagent wrote"):
        rp.parse_offer(b'{"job": "job-a"}\n', rp.Limits(JOB))


def test_a_torn_stream_is_never_done():
    line, rest = _stream(_marker())
    r, _ = _receive(line, rest[: len(rest) // 2], rp.Limits(JOB, {1}))
    assert not r.done
    with pytest.raises(rp.Refused, match="torn"):
        r.eof()


def test_bytes_that_differ_from_the_markers_checksum_are_refused():
    bad = dict(FILES, **{"__0_0.distcp": b"\0" * len(FILES["__0_0.distcp"])})
    line, rest = _stream(_marker(), files=bad)  # the sender's marker says the real CRC
    with pytest.raises(rp.Refused, match="checksum"):
        _receive(line, rest, rp.Limits(JOB, {1}))


def test_a_stream_altered_on_the_way_is_refused_by_its_hmac():
    # a stream from someone without the key: its CRCs match (it recomputed the marker), its
    # HMAC cannot
    line, rest = _stream(_marker(), key=rp.replica_key("guess", JOB))
    with pytest.raises(rp.Refused, match="altered"):
        _receive(line, rest, rp.Limits(JOB, {1}))


def test_bytes_after_the_end_are_refused():
    line, rest = _stream(_marker())
    with pytest.raises(rp.Refused, match="after the end"):
        _receive(line, rest + b"x", rp.Limits(JOB, {1}), piece=len(rest) + 1)


def test_the_copy_is_paced_to_its_bandwidth():
    from ftagent.checkpoint.replica import _Paced
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    p = _Paced(1000, clock=lambda: now[0], sleep=sleep)
    p.pace(500)  # 0.5 s worth at once: waits it out
    assert slept == [pytest.approx(0.5)]
    now[0] += 2.0  # the sender was slow anyway: no wait
    p.pace(1000)
    assert len(slept) == 1
    p.pace(3000)  # 4.5 s worth sent by t=2.5: waits 2 s
    assert slept[-1] == pytest.approx(2.0)
    unpaced = _Paced(0, clock=lambda: now[0], sleep=sleep)
    unpaced.pace(1 << 30)
    assert len(slept) == 2
