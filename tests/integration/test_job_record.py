"""Job history in Kubernetes (ftagent.kube.job_record): a bounded ConfigMap per job, written
debounced through the real ``kubernetes`` client to the fake API server, read back at
start; conflicts, API errors and garbage records; and through a real arbiter process: a
finished job's timeline in ``ftagent status JOB --json`` after the arbiter restarts."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from ftagent.arbiter.history import JobRecord
from ftagent.arbiter.timeline import Entry
from ftagent.kube.job_record import (
    LABEL,
    ConfigMaps,
    JobRecords,
    configmap_name,
    decode,
    encode,
    legacy_configmap_name,
)
from tests.arbiter_helpers import ArbiterProcess, wait_until
from tests.conftest import wait_for
from tests.integration.test_arbiter_history import (
    TOKEN,
    check_shown,
    jobs,
    run_two_jobs,
    status,
)
from tests.kube_fake import FakeKube

NS = "ftagent-system"


def must(obj: dict[str, Any] | None) -> dict[str, Any]:
    assert obj is not None, "no such object in the fake API server"
    return obj


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake
CM = "configmaps"
LLAMA = configmap_name("team", "llama")


def entry(seq: int, job: str = "llama", namespace: str = "team", msg: str = "") -> Entry:
    return Entry(seq, 1000.0 + seq, job, namespace, 0, "fault", msg or f"entry {seq}",
                 rank=seq % 4, fault_id=f"f{seq}")


def record(job: str = "llama", namespace: str = "team", phase: str = "succeeded",
           last_seen: float = 2000.0) -> JobRecord:
    return JobRecord(job=job, namespace=namespace, world_size=4, generation=2, restarts=1,
                     max_restarts=3, phase=phase, last_seen=last_seen,
                     restarts_by_reason={"CRASH": 1}, seconds_lost=7.5)


# ------------------------------------------------------------------ pure parts


def test_names_are_unambiguous_valid_object_names() -> None:
    assert re.fullmatch(r"ftagent-job\.team\.llama\.[0-9a-f]{20}", LLAMA)
    assert re.fullmatch(r"ftagent-job\.llama\.[0-9a-f]{20}", configmap_name("", "llama"))
    # a-b/c and a/b-c would collide with '-' as the separator
    assert configmap_name("a-b", "c") != configmap_name("a", "b-c")
    odd = configmap_name("Team_A", "Llama 70B/run")
    assert odd.startswith("ftagent-job.llama-70b-run.") and len(odd) <= 253
    assert odd == configmap_name("Team_A", "Llama 70B/run")
    assert odd != configmap_name("team_a", "Llama 70B/run")
    assert len(configmap_name("n" * 63, "j" * 300)) <= 253


def test_a_record_is_capped_newest_entries_kept_and_drops_counted() -> None:
    entries = [entry(i, msg="x" * 300) for i in range(1, 501)]
    data, dropped = encode(record(), entries, dropped=40, max_bytes=32 * 1024)
    assert sum(len(v.encode()) for v in data.values()) <= 32 * 1024
    rec, back, dropped_read = decode(data)
    assert rec == record()
    assert back and back[-1] == entries[-1]  # the newest is kept, in order
    assert [e.seq for e in back] == list(range(back[0].seq, 501))
    assert dropped == dropped_read == 40 + 500 - len(back)
    # one huge message is clipped, not the record
    data, _ = encode(record(), [entry(1, msg="y" * 100_000)], 0)
    _, back, _ = decode(data)
    assert len(back[0].message) == 1000


def test_the_ranks_owners_are_kept_when_they_fit() -> None:
    """The owners (arbiter restart: a rank stays its pod's) ride in record.json; a job so
    large that they would not fit a ConfigMap keeps its record and timeline without them."""
    rec = record(phase="running")
    rec.owners = [[r, f"pod-{r}", f"uid-{r}"] for r in range(4)]
    back, entries, _ = decode(encode(rec, [entry(1)], 0)[0])
    assert back.owners == rec.owners and len(entries) == 1
    huge = record(phase="running")
    huge.world_size = 20_000
    huge.owners = [[r, f"pod-{r:050d}", f"uid-{r:036d}"] for r in range(20_000)]
    data, _ = encode(huge, [entry(1)], 0)
    assert sum(len(v.encode()) for v in data.values()) < 256 * 1024
    back, entries, _ = decode(data)
    assert back.owners == [] and back.world_size == 20_000 and len(entries) == 1


@pytest.mark.parametrize("data", [
    None, {}, {"record.json": "not json"}, {"record.json": "[]"},
    {"record.json": json.dumps({"job": ""})},
    {"record.json": json.dumps({"job": "j", "phase": "exploded"})},
    {"record.json": json.dumps({"job": "j"}), "timeline.jsonl": "{\"seq\": 1}"},
    {"record.json": json.dumps({"job": "j"}), "timeline.jsonl": 5},
])
def test_garbage_records_are_refused(data: Any) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode(data)


def test_entries_of_another_job_are_not_taken() -> None:
    data, _ = encode(record(), [entry(1), entry(2, job="other")], 0)
    _, back, _ = decode(data)
    assert [e.job for e in back] == ["llama"]


# ------------------------------------------------------------------ against the fake server


def records(fake: FakeKube, **kw: Any) -> JobRecords:
    return JobRecords(ConfigMaps(fake.client(), NS, timeout=5.0), **kw)


def test_written_debounced_and_read_back(fake_kube: FakeKube) -> None:
    store = records(fake_kube, debounce=0.3)
    try:
        store.record(record(phase="running"))
        for i in range(1, 201):  # a burst: a few writes, not 200
            store.record(entry(i))
        store.record(record())
        assert store.flush(10)
        assert 1 <= store.writes <= 3, store.writes
        cm = fake_kube.get(CM, LLAMA, NS)
        assert cm is not None and cm["metadata"]["labels"][LABEL] == "job"
        assert cm["metadata"]["annotations"]["ftagent.io/job"] == "llama"
        store.record(entry(201))
        assert store.flush(10) and store.writes >= 2
    finally:
        store.close()
    again = records(fake_kube)
    try:
        got = again.load()
        assert [r.key for r in got.jobs] == [("team", "llama")]
        assert got.jobs[0].phase == "succeeded" and got.jobs[0].seconds_lost == 7.5
        assert [e.seq for e in got.entries] == list(range(1, 202))
        # an update after load replaces the object it read (no 409 loop, no duplicate)
        again.record(entry(202))
        assert again.flush(10)
        _, back, _ = decode(must(fake_kube.get(CM, LLAMA, NS))["data"])
        assert back[-1].seq == 202
        again.forget("team", "llama")
        assert again.flush(10)
        assert fake_kube.get(CM, LLAMA, NS) is None
    finally:
        again.close()


def test_a_conflict_rereads_and_writes_again(fake_kube: FakeKube) -> None:
    store = records(fake_kube, debounce=0.05)
    try:
        store.record(record())
        assert store.flush(10)
        cm = must(fake_kube.get(CM, LLAMA, NS))
        cm["metadata"]["labels"]["someone"] = "else"  # another writer bumps the version
        fake_kube.update(CM, cm)
        store.record(entry(1))
        assert store.flush(10)
        assert fake_kube.count("update", CM) >= 2  # the 409, then the write that won
        _, back, _ = decode(must(fake_kube.get(CM, LLAMA, NS))["data"])
        assert [e.seq for e in back] == [1]
    finally:
        store.close()


def test_api_errors_are_retried_and_logged_once(fake_kube: FakeKube,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ftagent.kube.job_record")
    fake_kube.forbid("create", CM, times=3)
    store = records(fake_kube, debounce=0.05)
    try:
        store.record(record())
        wait_for(lambda: fake_kube.get(CM, LLAMA, NS) is not None, 20,
                 "the record written once the 403s stop")
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "configmaps" in warnings[0] and "403" in warnings[0]
    finally:
        store.close()


def test_unreadable_records_are_skipped_and_an_unreachable_server_starts_empty(
        fake_kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    good, _ = encode(record(), [entry(1)], 0)
    fake_kube.create(CM, {"metadata": {"name": "ftagent-job.team.llama",
                                       "labels": {LABEL: "job"}}, "data": good}, NS)
    fake_kube.create(CM, {"metadata": {"name": "ftagent-job.x.y", "labels": {LABEL: "job"}},
                          "data": {"record.json": "{torn"}}, NS)
    caplog.set_level(logging.WARNING, "ftagent.kube.job_record")
    store = records(fake_kube)
    try:
        got = store.load()
        assert [r.job for r in got.jobs] == ["llama"] and len(got.entries) == 1
        assert any("skipped 1 ConfigMap" in r.getMessage() for r in caplog.records)
        fake_kube.fail("list", CM, code=500, times=1)
        assert store.load().jobs == []
    finally:
        store.close()


def test_two_jobs_names_never_collide() -> None:
    """Issue 20: job ``Llama`` in namespace ``team`` (no DNS label: hashed) was stored as
    ``ftagent-job.llama-<hash>``, which is also the plain name of a job called
    ``llama-<hash>`` with no namespace: that job's records replaced the other's."""
    victim = ("team", "Llama")
    hashed = legacy_configmap_name(*victim)
    attacker = ("", hashed.removeprefix("ftagent-job."))
    assert legacy_configmap_name(*attacker) == hashed  # the old names collided
    names = {configmap_name(*k) for k in (victim, attacker, ("team", "llama"),
                                          ("", "team.llama"), ("team.llama", ""))}
    assert len(names) == 5
    assert all(len(n) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", n)
               for n in names)


def test_records_under_earlier_names_are_read_and_moved(fake_kube: FakeKube) -> None:
    good, _ = encode(record(), [entry(1)], 0)
    old = legacy_configmap_name("team", "llama")
    fake_kube.create(CM, {"metadata": {"name": old, "labels": {LABEL: "job"}},
                          "data": good}, NS)
    store = records(fake_kube)
    try:
        got = store.load()
        assert [r.key for r in got.jobs] == [("team", "llama")] and len(got.entries) == 1
        assert store.flush(10)
        assert fake_kube.get(CM, old, NS) is None
        _, back, _ = decode(must(fake_kube.get(CM, LLAMA, NS))["data"])
        assert [e.seq for e in back] == [1]
    finally:
        store.close()
    again = records(fake_kube)  # read back from the new name only
    try:
        assert [r.key for r in again.load().jobs] == [("team", "llama")]
    finally:
        again.close()


# ------------------------------------------------------------------ a real arbiter


def test_a_finished_job_is_shown_after_an_arbiter_restart(fake_kube: FakeKube) -> None:
    """The --state-dir test's jobs, with the history in ConfigMaps instead: a succeeded
    job (a crash, a restart) and a stopped one, shown after a SIGKILL and restart."""
    with ArbiterProcess("--token", TOKEN, "--kube-api", fake_kube.url,
                        "--history-namespace", NS) as arbiter:
        asyncio.run(run_two_jobs(arbiter.address))
        asyncio.run(wait_until(lambda: all(j["connected"] == 0 for j in
                                           jobs(arbiter.address).values()), 10,
                               "every agent to leave"))
        check_shown(arbiter.address)
        before = status(arbiter.address, "fine")["timeline"]
        # debounced: the records land within a second or so
        wait_for(lambda: (cm := fake_kube.get(CM, configmap_name("", "fine"), NS)) is not None
                 and "job succeeded" in cm["data"]["timeline.jsonl"], 20,
                 "the finished job's record")
        wait_for(lambda: fake_kube.get(CM, configmap_name("", "halted"), NS) is not None, 20,
                 "the stopped job's record")
        arbiter.kill()
        arbiter.start()
        check_shown(arbiter.address)
        assert status(arbiter.address, "fine")["timeline"] == before
        assert arbiter.log_text().count("Traceback") == 0
