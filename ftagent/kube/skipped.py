"""An injected pod whose agent never connected gets one Kubernetes Event: the image cannot
skip the agent silently.

The entry shim (``packaging/ftagent-entry.sh``) runs the trainer alone when the agent
cannot start in the training image, and says why in one line on the container's stderr.
A pod holds no API credential, so it cannot write an Event or an annotation itself, and
nothing it says about itself is trusted here. What the arbiter observes is enough: an
injected pod (``ftagent.io/injected: true``, a container with ``FTAGENT_ARBITER``),
Running for longer than the grace, of which no agent holds a stream to this arbiter while
it leads. That pod is counted by the gauge (``uninjected.py``, reason
``agent not connected``) and gets one Warning Event ``FtagentAgentNotRunning``:

* once per pod uid (remembered while the pod runs, bounded) and leader's term: a pod is
  not re-announced at every pass (a failover may announce it once more: the new leader
  does not read the old one's Events);
* at most ``per_namespace`` Events per namespace per ``window``, and ``per_pass`` per pass
  over all namespaces: a namespace with thousands of such pods cannot flood the API server
  (the recorder's own token bucket is behind this too); the gauge still counts every pod,
  and a pod held back is announced once its namespace's window has room;
* the grace runs from the later of the pod's start and this arbiter's term as leader: a
  new leader, whose agents are still reconnecting, does not announce every pod at once.

The Event's message is the arbiter's own words; the pod's stated reason is not read (the
arbiter has no permission on pod logs, and the shim's line is the pod's word): the
message points at the container's log for it.

Pure at the core (:meth:`SkipEvents.due` takes the informer's pods, the connected set and
the time); :func:`announce_forever` is the loop's edge.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

from ftagent.kube.recorder import ObjectRef
from ftagent.kube.uninjected import AGENT_GRACE, INJECTED_OK, PodView, Term

log = logging.getLogger("ftagent.kube.skipped")

REASON = "FtagentAgentNotRunning"
PER_NAMESPACE = 10  # Events per namespace per window
WINDOW = 3600.0  # seconds
PER_PASS = 10  # Events per pass (every 5 s at most), all namespaces together: <= 2/s,
#   so the recorder's bucket (5/s) keeps room for fault Events
KEPT = 20_000  # pod uids remembered as announced (oldest forgotten first)

Record = Callable[[ObjectRef, str, str, str, float], None]


def message(view: PodView, now: float, grace: float) -> str:
    ran = int(now - view.since) if view.since is not None else 0
    return (f"ftagent's agent is not running in this injected pod: Running for {ran} s and "
            f"no agent of it has connected to the arbiter within {grace:g} s. The trainer "
            "runs without fault tolerance. Either the agent could not start in this image "
            "(the container's log says why, in one line starting 'ftagent: not started') "
            "or it cannot reach or authenticate to the arbiter.")


class SkipEvents:
    """Which injected pods to announce now (memory: the uids announced, each namespace's
    recent Events). Not thread-safe: one caller at a time (the announcing task)."""

    def __init__(self, grace: float = AGENT_GRACE, per_namespace: int = PER_NAMESPACE,
                 window: float = WINDOW, per_pass: int = PER_PASS, kept: int = KEPT) -> None:
        self.grace, self.per_namespace, self.window = grace, per_namespace, window
        self.per_pass, self.kept = per_pass, kept
        self._announced: OrderedDict[str, None] = OrderedDict()
        self._recent: dict[str, deque[float]] = {}
        self.held_back = 0  # pods due but over a limit, last pass (for tests and logs)

    def due(self, pods: Iterable[tuple[str, PodView | None]], opted_in: set[str],
            connected: set[tuple[str, str]] | None, term_since: float | None,
            now: float) -> list[PodView]:
        """The pods to announce now, marked as announced. Nothing while not leading."""
        self.held_back = 0
        if connected is None or term_since is None:
            return []
        out: list[PodView] = []
        running: set[str] = set()
        for _, v in pods:
            if v is not None and v.uid:
                running.add(v.uid)
            if v is None or v.reason != INJECTED_OK or v.since is None or not v.uid or \
                    v.namespace not in opted_in or v.uid in self._announced or \
                    now - max(v.since, term_since) <= self.grace or \
                    (v.namespace, v.name) in connected:
                continue
            recent = self._recent.setdefault(v.namespace, deque())
            while recent and now - recent[0] >= self.window:
                recent.popleft()
            if len(recent) >= self.per_namespace or len(out) >= self.per_pass:
                self.held_back += 1
                continue
            recent.append(now)
            self._announced[v.uid] = None
            while len(self._announced) > self.kept:
                self._announced.popitem(last=False)
            out.append(v)
        for ns in [ns for ns, d in self._recent.items() if not d or ns not in opted_in]:
            del self._recent[ns]
        for uid in [u for u in self._announced if u not in running]:  # gone: forgotten
            del self._announced[uid]
        return out


def pod_ref(view: PodView) -> ObjectRef:
    return ObjectRef("v1", "Pod", view.name, view.namespace, view.uid)


async def announce_forever(pods: Any, namespaces: Any, term: Term, skips: SkipEvents,
                           record: Record, clock: Callable[[], float],
                           period: float = 5.0) -> None:
    """Every ``period``: the connected set read on this loop (the registry lives here),
    the pods scanned in a worker thread (the informers' caches are thread-safe), one
    Warning Event recorded per pod due. Never raises out (a pass that fails is logged)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            now = clock()
            connected, since = term.observe(now)
            if connected is not None:
                opted_in = {name for _, name in namespaces.items()}
                due = await loop.run_in_executor(
                    None, functools.partial(skips.due, pods.items(), opted_in, connected,
                                            since, now))
                for v in due:
                    record(pod_ref(v), REASON, message(v, now, skips.grace), "Warning", now)
                if skips.held_back:
                    log.info("%d injected pod(s) without a connected agent not announced by "
                             "an Event yet (rate limit); the gauge counts them",
                             skips.held_back)
        except asyncio.CancelledError:
            raise
        except Exception:  # the next pass tries again; the gauge is unaffected
            log.exception("announcing pods without an agent")
        await asyncio.sleep(period)


def start_announcing(loop: asyncio.AbstractEventLoop, record: Record, grace: float = AGENT_GRACE,
                     clock: Callable[[], float] = time.time,
                     ) -> Callable[[Any, Any, Term], _Cancel]:
    """What ``uninjected.watch_uninjected(announce=...)`` calls with its opted-in pods,
    namespace informer and leader term: the announcing task on ``loop``, and its stop()."""

    def announce(pods: Any, namespaces: Any, term: Term) -> _Cancel:
        task = loop.create_task(announce_forever(
            pods, namespaces, term, SkipEvents(grace), record, clock,
            period=min(5.0, max(0.2, grace / 4))))
        return _Cancel(task)

    return announce


class _Cancel:
    """``stop()`` for the announcing task (from any thread)."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task

    def stop(self, timeout: float = 5.0) -> None:
        self.task.get_loop().call_soon_threadsafe(self.task.cancel)
