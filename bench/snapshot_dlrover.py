"""DLRover's flash checkpoint in bench/snapshot.py's loop: run by it with DLRover's own
virtualenv (``.bench-venvs/dlrover``, ``bash bench/peers.sh``), never the project's.

The same state, step loop, saves and faults as the other methods (``bench.snapshot.run``);
the save is ``DdpCheckpointer.save_checkpoint(step, state, storage_type=MEMORY)``: a copy
into shared memory that DLRover's saver process owns (started by the checkpointer when the
trainer does not run under ``dlrover-run``, whose agent would own it); the resume is
``load_checkpoint()`` from that memory, copied into a fresh state of the same shapes.
Prints one JSON line: the method's row and DLRover's version.

    .bench-venvs/dlrover/bin/python bench/snapshot_dlrover.py --gib 1 --saves 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
from importlib.metadata import version
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.snapshot import Method, make_state, run  # noqa: E402


def _copy_into(target: Any, loaded: Any) -> None:
    """Fill ``target``'s tensors in place from ``loaded`` (same keys), as a trainer's
    ``load_state_dict`` does; non-tensors replaced."""
    for k, v in loaded.items():
        if isinstance(v, dict):
            _copy_into(target[k], v)
        elif hasattr(v, "copy_") and hasattr(target.get(k), "copy_"):
            target[k].copy_(v)
        else:
            target[k] = v


class DlroverFlash(Method):
    name = "dlrover-flash"

    def __init__(self, root: str) -> None:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
        self.memory = StorageType.MEMORY
        self.ckpt = DdpCheckpointer(root)

    def save(self, i: int, state: dict[str, Any]) -> None:
        self.ckpt.save_checkpoint(i, state, storage_type=self.memory)

    def resume(self, target: dict[str, Any]) -> int | None:
        loaded = self.ckpt.load_checkpoint()
        if not loaded:
            return None
        _copy_into(target, loaded)
        step = target["optim"]["step"]
        return int(step) if step is not None else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--step-seconds", type=float, default=0.2)
    ap.add_argument("--faults", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disk", required=True, help="DLRover's checkpoint directory")
    a = ap.parse_args(argv)
    logging.disable(logging.INFO)  # DLRover logs each save at INFO
    for k, v in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    import torch
    torch.manual_seed(0)
    state = make_state(a.gib)
    m = DlroverFlash(a.disk)
    r = run(m, state, a.saves, a.every, a.step_seconds, a.faults, random.Random(a.seed))
    print(json.dumps({**r, "version": version("dlrover")}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # DLRover's saver process and its shared memory go with this process


if __name__ == "__main__":
    sys.exit(main())
