"""Waiting is not hanging: the agent's side of the arbiter's "job busy, no restart" verdict.

A rank whose trainer is verified hung *inside a collective* may only be waiting for a
peer busy elsewhere (rank 0 writing a silent checkpoint, rank 1 already in the next
all-reduce). So that rank does not raise the hang: it raises a WARNING suspicion
(``Verifier.ask_arbiter``; evidence ``waiting_in_collective``) that the arbiter decides
as a hang -- it collects every rank's stacks and liveness and either names a culprit and
restarts, or answers BUSY to every rank (``COMMAND_KIND_BUSY``). This module turns that
answer into what each rank records, by its part in it:

* **waiting** (this rank waits on a busy one): ``{"event": "peer", "kind": "waiting",
  "message": "waiting on rank 0 (busy in save (...))"}``, the gauge
  ``ftagent_waiting_on_busy_peer`` 1 until steps resume, and the stall is no hang while
  the wait lasts (bounded by --hang-phase-timeout; the busy rank's own agent declares it
  if it hangs);
* **busy** (this rank is the one verified busy): the event, nothing else changes;
* **culprit** (this rank spins while the others wait on it in a collective, behind in the
  flight recorder): its spin budget becomes ``--hang-culprit-spin-timeout`` from the stall's
  start, so a rank spinning in pure Python is declared in seconds, not after the general
  spin budget. Never when every rank is busy (an evaluation): the arbiter names no culprit.

Every rank also records the BUSY command itself as an ``action`` line (agent.py). Counts
go to ``ftagent_busy_verdicts_total{role}``. A log warning is the loudest this gets.

**Without an arbiter, in launcher mode** (``--nproc-per-node N``) the pod agent knows its
local peers: a rank verified waiting in a collective asks its local peers' verifiers for
their liveness (the answer the arbiter would get), and ``local_busy_peer`` (pure) picks the
one it waits on -- busy (alive, or spinning: then that peer gets the culprit spin budget),
not itself waiting or hung. The stall is then waiting, as under BUSY; with no busy local
peer the hang is declared as before.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ftagent.model import Action, ActionKind, JobBusy, Observation, Progress, TrainerStart

log = logging.getLogger("ftagent.peer_wait")


class BusyTarget(Protocol):
    """What the verdict changes in the hang verification (agent/verify.py's Verifier)."""

    def peer_busy(self, waiting_on: str) -> bool: ...

    def spin_culprit(self, budget: float) -> float | None: ...


def role_of(rank: int, busy: JobBusy) -> str:
    """This rank's part in a busy verdict: culprit, busy, waiting, or "" (not named)."""
    if rank in busy.spin_culprits:
        return "culprit"
    if rank in busy.busy_ranks:
        return "busy"
    if rank in busy.waiting_ranks:
        return "waiting"
    return ""


def waiting_text(busy: JobBusy) -> str:
    """``rank 0 (busy in save (serialization.py:966))``; several: ``ranks 0, 2 (...)``."""
    ranks = list(busy.busy_ranks)
    who = (f"rank {ranks[0]}" if len(ranks) == 1 else
           "ranks " + ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else ""))
    what = busy.state or "busy"
    if what == "alive":
        what = "busy"
    return f"{who} ({what} in {busy.where or 'its own code'})"


def local_busy_peer(peers: Mapping[int, Mapping[str, Any]]) -> tuple[int, str, str] | None:
    """Of the local peers' liveness answers (rank -> ``{"state", "where", "declared"}``, as
    ``Verifier.stacks_for_arbiter`` gives them), the one a rank verified waiting in a
    collective waits on: busy (``alive``, else ``spinning``), lowest rank first, never one
    that declared a hang. None when no peer explains the wait (all hung -- waiting in a
    collective too -- unknown, declared, or none answered): the hang stands."""
    best: tuple[int, int, str, str] | None = None
    for rank, live in peers.items():
        state = live.get("state")
        if live.get("declared") or state not in ("alive", "spinning"):
            continue
        where = str(live.get("where") or "its own code")
        key = (0 if state == "alive" else 1, rank, str(state), where)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[1], best[2], best[3])


def local_waiting_text(rank: int, state: str, where: str) -> str:
    """``local rank 0 (busy in evaluate (train.py:88))``: whom a stall waits on."""
    return f"local rank {rank} ({'busy' if state == 'alive' else state} in {where})"


class PeerWait:
    """Applies BUSY commands to this rank's hang verification, events and metrics."""

    # what the watch loop hands it (watch/loop.py ``_route``): the two that end a wait;
    # an exit, a phase or a GPU event never called it for nothing
    observes = (Progress, TrainerStart)

    def __init__(self, rank: int | Callable[[], int], target: BusyTarget | None,
                 record: Callable[..., Any] | None, metrics: Any = None, *,
                 culprit_spin_timeout: float = 30.0) -> None:
        """``rank``: this rank, or how to read it when a verdict arrives (the worker's
        lifecycle: a spare that took over rank 3 judges verdicts as rank 3)."""
        self._rank = rank
        self.target = target
        self.record = record
        self.metrics = metrics
        self.culprit_spin_timeout = culprit_spin_timeout
        self.waiting = False

    @property
    def rank(self) -> int:
        """This rank now (read, never copied: lifecycle.py owns it)."""
        return self._rank() if callable(self._rank) else self._rank

    def on_action(self, action: Action) -> None:
        if action.kind is not ActionKind.BUSY or action.busy is None:
            return
        busy = action.busy
        role = role_of(self.rank, busy)
        fields: dict[str, Any] = {
            "busy_ranks": list(busy.busy_ranks), "waiting_ranks": list(busy.waiting_ranks),
            "where": busy.where, "state": busy.state, "action_id": action.id}
        if role == "waiting":
            on = waiting_text(busy)
            open_stall = self.target.peer_busy(on) if self.target is not None else False
            self.waiting = True
            self._gauge(1.0)
            msg = f"waiting on {on}: the arbiter judged the job busy, not hung"
            log.warning("%s", msg)
            self._record("waiting", msg, waiting_on=on, stall_open=open_stall, **fields)
        elif role == "culprit":
            again = None if self.target is None else \
                self.target.spin_culprit(self.culprit_spin_timeout)
            msg = (f"rank {self.rank} spins in {busy.where or 'its own code'} while rank "
                   f"{', '.join(map(str, busy.waiting_ranks[:8]))} wait(s) on it in a "
                   f"collective: declared hung if it still spins "
                   f"{self.culprit_spin_timeout:.0f}s after its last step "
                   "(--hang-culprit-spin-timeout)")
            log.warning("%s", msg)
            self._record("culprit", msg, spin_budget_seconds=self.culprit_spin_timeout,
                         check_again_in=None if again is None else round(again, 3), **fields)
        elif role == "busy":
            msg = (f"the arbiter judged the job busy, not hung: this rank is busy in "
                   f"{busy.where or 'its own code'}; rank "
                   f"{', '.join(map(str, busy.waiting_ranks[:8])) or '-'} wait(s) for it")
            log.info("%s", msg)
            self._record("busy", msg, **fields)
        else:
            return
        m = self.metrics
        if m is not None:
            with contextlib.suppress(Exception):
                m.busy_verdicts.labels(**m.labels(role=role)).inc()

    def observe(self, obs: Observation) -> None:
        """Steps resumed, or a new trainer: no longer waiting."""
        if self.waiting and isinstance(obs, (Progress, TrainerStart)):
            self.waiting = False
            self._gauge(0.0)

    def _gauge(self, value: float) -> None:
        m = self.metrics
        if m is not None:
            with contextlib.suppress(Exception):
                m.waiting_on_busy_peer.set(value)

    def _record(self, kind: str, message: str, **fields: Any) -> None:
        if self.record is not None:
            self.record("peer", kind, message, **fields)
