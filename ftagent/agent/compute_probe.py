"""Preflight's device-memory and compute check on CUDA, run in a child process.

``python -m ftagent.agent.compute_probe [--bytes N] [--device cuda|cpu]`` prints
``{"ready": N}`` once torch is imported and N devices are seen (the parent's budget
judges only what follows: a slow import is no device fault), then one JSON line:
``{"path": "cuda", "devices": [{"index": 0, "why": ""}, ...]}`` (``why`` empty when the
device passed) or ``{"path": "none", "why": "..."}`` when there is no compute path here
(torch not importable, no CUDA device visible). Exit status 0 either way; anything else
(a crash, a hang the parent kills at its budget) is the parent's to judge.

Why a child: NVML reads a device's state but cannot run a kernel, and the agent never
imports torch (it must start in milliseconds and never share the trainer's CUDA
context). The child runs before the trainer starts (preflight holds the barrier), sees
the devices the trainer will see (the same ``CUDA_VISIBLE_DEVICES``), and exits, freeing
its context before the trainer creates one.

Per device, small and deterministic: ``--bytes`` (default 64 MiB) written with a pattern
and read back (compared on the device, one bool crosses), an ``arange`` summed (its
closed form known), and a 256x256 matmul of ones (every entry 256, exact in float32).
A CUDA error (an uncorrectable ECC error, a device that fell off the bus) is that
device's ``why``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEFAULT_BYTES = 64 << 20
PATTERN = 0x5A5A5A5A
SIDE = 256


def check(torch: Any, device: Any, nbytes: int) -> str:
    """'' when ``device`` stores, reads back and computes right, else why not."""
    n = max(1024, nbytes // 4)
    a = torch.full((n,), PATTERN, dtype=torch.int32, device=device)
    if not bool((a == PATTERN).all()):
        return f"memory: a {n * 4}-byte pattern did not read back"
    del a
    b = torch.arange(n, dtype=torch.int64, device=device)
    got = int(b.sum())
    if got != n * (n - 1) // 2:
        return f"compute: the sum of arange({n}) is {got}, not {n * (n - 1) // 2}"
    del b
    m = torch.ones((SIDE, SIDE), dtype=torch.float32, device=device)
    r = m @ m
    if not bool((r == float(SIDE)).all()):
        return f"compute: a {SIDE}x{SIDE} matmul of ones is wrong"
    return ""


def run(nbytes: int, device: str = "cuda") -> dict[str, Any]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 -- no torch here: no compute path
        return {"path": "none", "why": f"torch is not importable ({type(e).__name__})"}
    if device == "cpu":
        targets: list[tuple[int, Any]] = [(0, torch.device("cpu"))]
    else:
        if not torch.cuda.is_available():
            return {"path": "none", "why": "torch sees no CUDA device"}
        targets = [(i, torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    print(json.dumps({"ready": len(targets)}), flush=True)
    out = []
    for i, dev in targets:
        try:
            why = check(torch, dev, nbytes)
            if device != "cpu":
                torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 -- a CUDA error is this device's answer
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        out.append({"index": i, "why": why})
    return {"path": device, "devices": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftagent.agent.compute_probe")
    p.add_argument("--bytes", type=int, default=DEFAULT_BYTES)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = p.parse_args(argv)
    print(json.dumps(run(max(0, min(a.bytes, 1 << 34)), a.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
