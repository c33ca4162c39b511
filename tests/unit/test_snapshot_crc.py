"""The snapshot checksum computed on every core (checkpoint/crc.py) is zlib's CRC-32:
the markers written before read the same, whatever the split."""

from __future__ import annotations

import mmap
import os
import random
import zlib

import pytest

from ftagent.checkpoint import crc


def test_combine_is_zlibs_crc32_combine() -> None:
    rng = random.Random(7)
    data = rng.randbytes(5000)
    for cut in (0, 1, 2, 3, 7, 8, 255, 256, 1000, 4999, 5000):
        a, b = data[:cut], data[cut:]
        assert crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data), cut


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("size", [0, 1, 1000, 4096 + 3, 65537])
def test_parallel_crc_equals_one_pass(monkeypatch: pytest.MonkeyPatch, threads: int,
                                      size: int) -> None:
    monkeypatch.setattr(crc, "SEGMENT_MIN", 1000)  # small buffers split too
    data = random.Random(size).randbytes(size)
    assert crc.crc32(data, threads) == zlib.crc32(data)


def test_a_mapping_can_be_closed_after_its_crc(tmp_path: object,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No view of the mapping is left behind (the load unmaps the shard once loaded)."""
    monkeypatch.setattr(crc, "SEGMENT_MIN", 1 << 12)
    path = os.path.join(str(tmp_path), "f")
    data = os.urandom(1 << 16)
    with open(path, "wb") as f:
        f.write(data)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    assert crc.crc32(m, 4) == zlib.crc32(data)
    m.close()  # BufferError if a view were still exported


def test_one_flipped_byte_changes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crc, "SEGMENT_MIN", 1 << 10)
    data = bytearray(random.Random(1).randbytes(1 << 14))
    before = crc.crc32(bytes(data), 4)
    data[9000] ^= 0x01
    assert crc.crc32(bytes(data), 4) != before
