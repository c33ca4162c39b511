"""The agent persists snapshots in the background: every N-th one its trainer reports
complete, or once T seconds have passed since the last one persisted, the newest complete
snapshot of the rank goes to the job's durable checkpoint directory (persist.py: standard
DCP layout, marker last, retention), in a thread of the agent: never in the training step,
and a trainer that crashes meanwhile does not stop it.

One copy at a time: a snapshot reported while one is being copied waits for the next turn
(the next report that is due). :func:`due` is the pure rule.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ftagent.checkpoint import layout, persist
from ftagent.model import Observation, SnapshotsHeld

log = logging.getLogger("ftagent.checkpoint")


def due(new_since: int, seconds_since: float, *, every: int, seconds: float) -> bool:
    """Persist now? ``new_since`` newer snapshots were reported since the last persisted
    one, ``seconds_since`` have passed since it (or since the start)."""
    return new_since > 0 and ((every > 0 and new_since >= every)
                              or (seconds > 0 and seconds_since >= seconds))


class BackgroundPersist:
    """An observer of the worker's observations (``SnapshotsHeld``); see the module."""

    def __init__(self, root: str, job: str, rank: Callable[[], int], durable: str, *,
                 every: int, seconds: float, keep: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root, self.job, self.rank, self.durable = root, job, rank, durable
        self.every, self.seconds, self.keep, self.clock = every, seconds, keep, clock
        self._newest: int | None = None
        self._new_since = 0
        self._since = clock()
        self._thread: threading.Thread | None = None
        self.persisted: list[tuple[int, float]] = []  # (step, seconds) of each copy

    def observe(self, obs: Observation) -> None:
        if not isinstance(obs, SnapshotsHeld) or not obs.steps:
            return
        newest = obs.steps[-1]
        if newest == self._newest:
            return
        self._newest = newest
        self._new_since += 1
        now = self.clock()
        if self.busy() or not due(self._new_since, now - self._since, every=self.every,
                                  seconds=self.seconds):
            return
        self._new_since, self._since = 0, now
        self._thread = threading.Thread(target=self._copy, args=(self.rank(), newest),
                                        name="ftagent-persist", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _copy(self, rank: int, step: int) -> None:
        t0 = time.monotonic()
        src = layout.step_dir(self.root, self.job, rank, step)
        try:
            layout.verify(src, job=self.job, rank=rank, step=step)
            persist.persist(src, self.durable, rank=rank, step=step, keep=self.keep)
        except (layout.SnapshotRejected, OSError) as e:
            log.warning("snapshot of step %d not persisted: %s", step, e)
            return
        took = time.monotonic() - t0
        self.persisted.append((step, took))
        log.info("persisted rank %d's snapshot of step %d to %s in %.2fs", rank, step,
                 self.durable, took)
