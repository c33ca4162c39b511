"""CRC-32 (zlib's) of a large buffer on every core: the snapshot's checksum at memory speed.

A shard's marker carries each file's CRC-32 (layout.py); the load checks it over the
mapped file before DCP fills the state, and the writer computes it after DCP wrote the
file. One ``zlib.crc32`` runs at about 1 GiB/s on one core, the resume's largest part at
1 GiB. ``zlib.crc32`` releases the GIL on a large buffer, so the buffer is cut into one
segment per core, each segment's CRC computed in a thread, and the segments' CRCs joined
with zlib's ``crc32_combine`` (the CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and
``len(B)``: the shift of ``crc(A)`` by ``len(B)`` zero bytes, a 32x32 matrix over GF(2)
applied once; the matrix for each segment length computed once and kept). The same value
as ``zlib.crc32(buffer)``, so markers written before read the same.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # collections.abc.Buffer from Python 3.12; the agent imports no more
    from typing_extensions import Buffer

_POLY = 0xEDB88320  # CRC-32's polynomial, reflected (zlib's)
SEGMENT_MIN = 16 << 20  # below it one thread: a thread's start costs more than it saves


def _times(mat: tuple[int, ...], vec: int) -> int:
    """The GF(2) matrix ``mat`` (32 columns, as ints) times the 32-bit vector ``vec``."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> tuple[int, ...]:
    """The operator that appends ``nbytes`` zero bytes to a CRC-32 (zlib's
    crc32_combine, as a matrix): ``crc(A + B) = shift(len(B)) * crc(A) ^ crc(B)``."""
    odd = (_POLY, *(1 << n for n in range(31)))  # one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four
    result: tuple[int, ...] | None = None
    n = nbytes
    while n:
        even = _square(odd)  # the first: one zero byte; then 4, 16, ... bytes
        if n & 1:
            result = even if result is None else tuple(_times(even, c) for c in result)
        n >>= 1
        if not n:
            break
        odd = _square(even)  # 2, 8, 32, ... bytes
        if n & 1:
            result = odd if result is None else tuple(_times(odd, c) for c in result)
        n >>= 1
    return result if result is not None else tuple(1 << n for n in range(32))


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and
    ``len2 = len(B)`` (zlib's ``crc32_combine``)."""
    if len2 <= 0:
        return crc1
    return _times(_shift(len2), crc1) ^ crc2


def crc32(data: Buffer, threads: int | None = None) -> int:
    """``zlib.crc32(data)``, computed in ``threads`` threads (default: the CPUs this
    process may run on), one contiguous segment each."""
    with memoryview(data) as whole, whole.cast("B") as view:  # released: the caller
        size = len(view)                                     # may close an mmap after
        n = threads if threads is not None else cpus()
        n = max(1, min(n, size // SEGMENT_MIN))
        if n == 1:
            return zlib.crc32(view)
        seg = -(-size // n)
        bounds = [(i, min(size, i + seg)) for i in range(0, size, seg)]

        def part(b: tuple[int, int]) -> int:
            with view[b[0]:b[1]] as piece:
                return zlib.crc32(piece)

        with concurrent.futures.ThreadPoolExecutor(len(bounds), "ftagent-crc") as pool:
            parts = list(pool.map(part, bounds))
    out = parts[0]
    for (lo, hi), c in zip(bounds[1:], parts[1:], strict=True):
        out = combine(out, c, hi - lo)
    return out


def cpus() -> int:
    """The CPUs this process may run on (its affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
