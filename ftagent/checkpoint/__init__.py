"""Snapshots of the training state that outlive the trainer: ``from ftagent import checkpoint``.

::

    from ftagent import checkpoint
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    start = checkpoint.load(state)          # the newest complete snapshot's step, or None
    model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optim"])
    for step in range(0 if start is None else start + 1, steps):
        train_step()
        if step % 50 == 0:
            checkpoint.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})

Under ``ftagent run`` (it sets ``FTAGENT_SNAPSHOT_DIR``, a memory-backed directory), ``save``
returns once the state is copied into host memory; DCP writes the copy into this rank's
shard in the background (snapshots.py). ``load`` fills ``state`` in place from the newest
snapshot complete on every rank (the arbiter's ``FTAGENT_RESUME_STEP`` after a restart),
falling to the durable copy (``FTAGENT_CHECKPOINT_DIR``), and returns its step. Call both on
every rank: with torch.distributed initialized they may use a collective.

Without the agent (no ``FTAGENT_SNAPSHOT_DIR``) both do the plain DCP thing in
``checkpoint_dir`` (the argument, else ``FTAGENT_CHECKPOINT_DIR``): ``save`` is
``dcp.save(state, checkpoint_id=<dir>/step-<N>)``, ``load`` the newest ``step-<N>`` whose
``.metadata`` DCP wrote. See docs/snapshots.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from typing import Any

from ftagent.checkpoint.layout import SnapshotRejected

__all__ = ["SnapshotRejected", "load", "save", "wait"]

# the one Snapshotter of this process (like the SDK's client: see STYLE.md), made on first use
_snapshotter: Any = None


def _current(checkpoint_dir: str | None) -> Any:
    global _snapshotter
    from ftagent.checkpoint.settings import Settings
    from ftagent.checkpoint.snapshots import Snapshotter
    s = Settings.from_env(checkpoint_dir=checkpoint_dir)
    if _snapshotter is None or _snapshotter.s != s:
        if _snapshotter is not None:
            _snapshotter.close()
        _snapshotter = Snapshotter(s)
    return _snapshotter


def save(step: int, state_dict: Mapping[str, Any], *, checkpoint_dir: str | None = None) -> bool:
    """Snapshot ``state_dict`` as step ``step`` (the step just completed). Under the agent:
    returns once the state is copied (True), or at once when the previous snapshot is
    still being written (False, said once). Without it: a plain, blocking DCP save."""
    if os.environ.get("FTAGENT_SNAPSHOT_DIR"):
        return bool(_current(checkpoint_dir).save(step, state_dict))
    import torch.distributed.checkpoint as dcp
    where = checkpoint_dir or os.environ.get("FTAGENT_CHECKPOINT_DIR", "")
    if not where:
        raise ValueError("ftagent.checkpoint.save: not under `ftagent run` and no "
                         "checkpoint_dir (or FTAGENT_CHECKPOINT_DIR) to save to")
    dcp.save(dict(state_dict), checkpoint_id=os.path.join(where, f"step-{step}"))
    return True


def load(state_dict: MutableMapping[str, Any], *, checkpoint_dir: str | None = None) -> int | None:
    """Fill ``state_dict`` in place from the newest complete snapshot (memory, then disk)
    and return its step; None (``state_dict`` untouched) when there is none."""
    if os.environ.get("FTAGENT_SNAPSHOT_DIR"):
        step: int | None = _current(checkpoint_dir).load(state_dict)
        return step
    where = checkpoint_dir or os.environ.get("FTAGENT_CHECKPOINT_DIR", "")
    if not where:
        return None
    import torch.distributed.checkpoint as dcp
    try:
        names = os.listdir(where)
    except OSError:
        return None
    steps = sorted(int(m.group(1)) for n in names
                   if (m := re.fullmatch(r"step-(\d{1,18})", n))
                   and os.path.isfile(os.path.join(where, n, ".metadata")))
    if not steps:
        return None
    dcp.load(state_dict, checkpoint_id=os.path.join(where, f"step-{steps[-1]}"))
    return steps[-1]


def wait(timeout: float | None = None) -> bool:
    """Until the snapshot being written in the background is complete (True), or
    ``timeout`` passes (False). Nothing to wait for without the agent."""
    if _snapshotter is None:
        return True
    return bool(_snapshotter.wait(timeout))
