"""save's blocking copy (snapshots.stage + copy_bulk): a large dense host tensor is copied
into its staging buffer by libc's memmove in 8 MiB segments on every core; anything else
(small, non-contiguous, another dtype or shape) by torch's copy_. Either way the staged
state is the state, byte for byte, at the moment save returns."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from ftagent.checkpoint import snapshots
from ftagent.checkpoint.snapshots import BULK_MIN, copy_bulk, stage


def _state(k: float) -> dict[str, object]:
    big = torch.arange((3 << 20) + 5, dtype=torch.float32) * k  # 12 MiB + 20 bytes
    return {"big": big, "bf": torch.full((1 << 20,), k, dtype=torch.bfloat16),
            "small": torch.full((7,), k), "strided": torch.arange(4096.0).reshape(64, 64).t() * k,
            "ints": torch.arange(1 << 19, dtype=torch.int64) + int(k), "step": int(k)}


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_the_staged_copy_is_the_state_byte_for_byte(threads: int) -> None:
    pool = concurrent.futures.ThreadPoolExecutor(threads) if threads else None
    staged = stage(_state(1.0))  # the first save allocates
    buffers = {k: v.data_ptr() for k, v in staged.items() if isinstance(v, torch.Tensor)}
    for k in (2.0, 3.0):
        bulk: list[tuple[torch.Tensor, torch.Tensor]] = []
        want = _state(k)
        staged = stage(want, staged, bulk)
        assert {s.nbytes for _, s in bulk} >= {want["big"].nbytes, want["ints"].nbytes}  # type: ignore[union-attr]
        assert all(s.nbytes >= BULK_MIN for _, s in bulk)
        copy_bulk(bulk, pool)
        for name, v in want.items():
            if isinstance(v, torch.Tensor):
                assert staged[name].data_ptr() == buffers[name]  # reused, not reallocated
                assert torch.equal(staged[name], v), name
            else:
                assert staged[name] == v
    if pool is not None:
        pool.shutdown()


def test_segments_cover_every_byte_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "_SEGMENT", 1000)
    src = torch.randint(0, 255, (10_007,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        copy_bulk([(dst, src)], pool)
    assert torch.equal(dst, src)


def test_a_view_or_a_lazy_conjugate_is_copied_by_torch() -> None:
    base = torch.arange(float(1 << 19))
    conj = torch.complex(base, base).conj()  # a lazy conjugate: its bytes are not its values
    assert not snapshots._plain_host(base[::2]) and not snapshots._plain_host(conj)
    staged = stage({"v": base[::2], "c": conj}, None)
    bulk: list[tuple[torch.Tensor, torch.Tensor]] = []
    staged = stage({"v": base[1::2], "c": conj * 2}, staged, bulk)
    copy_bulk(bulk, None)
    assert torch.equal(staged["v"], base[1::2]) and torch.equal(staged["c"], conj * 2)
