"""The newest step a job can resume from memory: every rank's snapshot of it is complete.

Each rank's agent says which steps its trainer holds a complete in-memory snapshot of
(``SnapshotReport``, ``ftagent.checkpoint``); a step is usable only when every rank of the
job holds it, so the resume step is the newest step in all of them. Pure: it reads the
ranks' last reports and nothing else. A rank that never reported, or a job whose ranks
are not all known yet, has none.
"""

from __future__ import annotations

from ftagent.arbiter.state import JobState


def resume_step(job: JobState) -> int | None:
    """The newest step every rank of ``job`` (0..world_size-1) holds (None: none)."""
    held = []
    for r in range(job.world_size):
        rs = job.ranks.get(r)
        if rs is None or not rs.snapshot_steps:
            return None
        held.append(set(rs.snapshot_steps))
    common = set.intersection(*held) if held else set()
    return max(common) if common else None
