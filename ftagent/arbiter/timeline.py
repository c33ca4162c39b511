"""Each job's timeline: what happened and what was decided, in order, with reasons.

The timeline is what ``ftagent status`` shows and ``WatchEvents`` streams; every entry is
also logged, so the arbiter's log reads the same story. Entries are kept per job in a
bounded deque. Each entry also goes to ``sink`` (the job history, ``history.py``), and
``seed`` puts back what the history kept across an arbiter restart; decisions never read
the timeline.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

from ftagent.arbiter.state import Culprit
from ftagent.wire.limits import clip, printable

log = logging.getLogger("ftagent.arbiter.timeline")

KEEP_PER_JOB = 1000
MAX_ENTRY_MESSAGE = 1000  # characters of an entry's message (escaped) kept: a job's
# timeline holds at most ~1 MB of text whatever its peers send (a fault's is 4 KiB)
MAX_ENTRY_CULPRITS = 64  # culprits one entry keeps as data (a decision names more by count)
WATCH_QUEUE = 10_000  # entries a slow watcher may lag behind before it is dropped


@dataclass(frozen=True, slots=True)
class Entry:
    seq: int
    ts: float
    job: str
    namespace: str
    generation: int
    kind: str  # agent | fault | decision | barrier | stacks | exit
    message: str
    rank: int | None = None
    fault_id: str = ""
    action: str = ""
    # a decision's culprits (Decision.culprits): rank, pod and node as data, the same
    # ranks its message names
    culprits: tuple[Culprit, ...] = ()


class Watcher:
    """One WatchEvents subscriber: entries of one job (or all), queued for the stream."""

    def __init__(self, job: str, namespace: str) -> None:
        self.job = job
        self.namespace = namespace
        self.queue: asyncio.Queue[Entry | None] = asyncio.Queue(WATCH_QUEUE)
        # why the stream ends though the watcher keeps up ("" while it does not): with
        # None queued, the server ends the stream UNAVAILABLE with this, not "fell behind"
        self.ended = ""

    def wants(self, e: Entry) -> bool:
        return (not self.job or e.job == self.job) and (
            not self.namespace or e.namespace == self.namespace)


class Timeline:
    def __init__(self, keep_per_job: int = KEEP_PER_JOB,
                 sink: Callable[[Entry], None] | None = None) -> None:
        self._keep = keep_per_job
        self._jobs: dict[tuple[str, str], deque[Entry]] = {}
        self._seq = 0
        self._watchers: set[Watcher] = set()
        self.sink = sink

    def seed(self, entries: Iterable[Entry]) -> None:
        """Entries kept from before a restart (in seq order); new ones number after them."""
        for e in entries:
            if not e.message.isprintable():  # a history written before escaping
                e = replace(e, message=printable(e.message))
            q = self._jobs.get((e.namespace, e.job))
            if q is None:
                q = self._jobs[(e.namespace, e.job)] = deque(maxlen=self._keep)
            q.append(e)
            self._seq = max(self._seq, e.seq)

    def add(self, now: float, job: str, namespace: str, generation: int, kind: str,
            message: str, *, rank: int | None = None, fault_id: str = "",
            action: str = "", culprits: tuple[Culprit, ...] = ()) -> Entry:
        self._seq += 1
        # The bound of every entry, checked here, its one entry point: a clean message
        # within the length is kept as it is (the common case: no call out); any other
        # is escaped, then clipped (wire/limits).
        if len(message) > MAX_ENTRY_MESSAGE or not message.isprintable():
            message = clip(printable(message), MAX_ENTRY_MESSAGE)
        e = Entry(self._seq, now, job, namespace, generation, kind, message, rank, fault_id,
                  action, culprits[:MAX_ENTRY_CULPRITS])
        q = self._jobs.get((namespace, job))
        if q is None:
            q = self._jobs[(namespace, job)] = deque(maxlen=self._keep)
        q.append(e)
        if self.sink is not None:
            self.sink(e)
        level = logging.WARNING if kind == "decision" and action in ("stop", "replace") \
            else logging.INFO
        log.log(level, "%s%s g%d %s%s", f"{namespace}/" if namespace else "", job, generation,
                f"rank {rank}: " if rank is not None and kind != "decision" else "", message)
        for w in list(self._watchers):
            if w.wants(e):
                try:
                    w.queue.put_nowait(e)
                except asyncio.QueueFull:  # a watcher that does not read loses its stream
                    self._end(w)
        return e

    def entries(self, job: str, namespace: str, limit: int = 0) -> list[Entry]:
        q = self._jobs.get((namespace, job))
        if q is None:
            return []
        items = list(q)
        return items[-limit:] if limit > 0 else items

    def all_entries(self) -> Iterator[Entry]:
        for q in self._jobs.values():
            yield from q

    def replay(self, job: str, namespace: str, limit: int = KEEP_PER_JOB) -> list[Entry]:
        """What a new watcher of ``job`` in ``namespace`` ("" for any) is sent first: the
        newest ``limit`` matching entries, oldest first. The cost is that of one job's
        timeline (a merge of the newest ends of the matching jobs), never a sort of
        every job's, so a watcher cannot make the arbiter's event loop sort them all."""
        queues = [q for (ns, name), q in self._jobs.items()
                  if (not job or name == job) and (not namespace or ns == namespace)]
        newest = heapq.merge(*(reversed(q) for q in queues), key=lambda e: -e.seq)
        out = list(itertools.islice(newest, max(0, limit)))
        out.reverse()
        return out

    def forget(self, job: str, namespace: str) -> None:
        self._jobs.pop((namespace, job), None)

    def watch(self, job: str, namespace: str) -> Watcher:
        w = Watcher(job, namespace)
        self._watchers.add(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        self._watchers.discard(w)

    def end_watches(self, why: str) -> None:
        """End every watcher's stream after what it was sent (an arbiter that stops
        leading: this timeline gets nothing more, and a follower waiting on it would wait
        forever). The end is queued behind the entries; a full queue is dropped for it."""
        for w in list(self._watchers):
            self._end(w, why)

    def _end(self, w: Watcher, why: str = "") -> None:
        """No more entries for ``w``: None queued (behind what it has, or alone if its
        queue is full: then it is not waiting on get(), and its next get() sees it)."""
        self._watchers.discard(w)
        w.ended = why
        try:
            w.queue.put_nowait(None)
        except asyncio.QueueFull:
            w.queue = asyncio.Queue(1)
            w.queue.put_nowait(None)
