"""The stall policy: one pure function from a stalled rank's evidence to one ``Verdict``.

A rank's step budget ran out (``detect/hang.py``), or it sits in a phase or before its first
step long enough to be looked at. The agent samples the trainer's tree (``agent/verify.py``:
stacks, CPU, I/O bytes, /proc thread states and wait channels, what each blocked thread's
file descriptor points at) and the motion judge (``detect/liveness.judge``) says whether the
stacks moved. ``decide`` turns that, the budget state and what the arbiter relays about the
peers into one ``Verdict``: a state, what to do, why, and the ranks to blame. Pure: no
clock, no I/O (a test reads this module's imports); every input is a value.

The table (first matching row wins; each row has its test in ``tests/unit/test_stall.py``,
and ``docs/hangs.md`` carries the same table):

====  ==================================================  ===============  =======
row   evidence                                            state            act
====  ==================================================  ===============  =======
U1    samples contradict each other, /proc vanished       undecided        recheck
      mid-read, stacks that lie, a torn or other-
      generation flight-recorder dump; stalled below
      --hang-phase-timeout
U2    the same, stalled past --hang-phase-timeout         hung             declare
F1    a process of the tree stopped (state T or t, or     frozen           declare
      a freezer wait channel) in every sample                              + SIGKILL
F2    a process in uninterruptible sleep (D) in every     frozen           declare
      sample, its storage I/O not advancing                                + SIGKILL
P1    waiting in a collective, the arbiter (or a local    waiting_on_peer  recheck
      peer) names the busy rank it waits on; below
      --hang-phase-timeout
I1    every still thread blocked reading a socket to a    waiting_on_io    recheck
      non-peer or a file on a network mount, nothing
      working; stalled below --hang-io-timeout
I2    the same, stalled past --hang-io-timeout            hung             declare
I3    the remote read the last verdict (I1) saw ended     waiting_on_io    recheck
      inside this window (no thread on remote I/O now,
      its place changed), still nothing working: once
      per read, below --hang-io-timeout
D1    in a phase (declared, or never learned) or before   dead_still       declare
      the first step: every thread blocked, no CPU, no
      I/O, no stack movement over --hang-dead-still-
      window; not in a collective, a rendezvous or a
      store wait (peers), not in a sleep (timed)
D2    in a phase or before the first step, any sign of    (its state)      none
      life: the phase budget holds
A1    the stacks move (its code advances)                 progressing      recheck
A2    alive by storage I/O alone, below                   busy             recheck
      --hang-phase-timeout
A3    alive by storage I/O alone, past it                 hung             declare
S1    spinning (one line, CPU advancing), below its spin  spinning         recheck
      budget
S2    spinning past its spin budget                       hung             declare
C1    still in a collective, an arbiter to ask, not       waiting_on_peer  ask
      asked yet
C2    still in a collective, asked, no answer yet (for    waiting_on_peer  recheck
      less than ``answer_wait``), no busy peer named
H1    still (parked or waiting) outside the rows above    hung             declare
H2    nothing readable (no stacks, CPU in between)        hung             declare
====  ==================================================  ===============  =======

The arbiter's rows: the flight recorder's per-group positions over every rank of the job
(``arbiter/fr_verdict.decide``, the same ``Verdict``; its ``kind`` names the row's finding;
per group, innermost first, the first of R1-R4 found wins):

====  ==================================================  ===============  =======
row   evidence (per process group)                        state            act
====  ==================================================  ===============  =======
R1    mismatch: ranks at one sequence number, not all     hung             declare
      complete, with different op, sizes or dtypes
R2    behind: a rank whose last enqueued collective is    hung             declare
      below the group's highest (not one waiting in an
      inner group's collective)
R3    unresponsive: a rank with no dump while a rank      hung             declare
      that sent one waits inside a collective
R4    stall: every rank inside one collective, none       hung             declare
      behind, none silent
R0    none of those                                       undecided        none
====  ==================================================  ===============  =======

Why the order: bad evidence first (never act on a guess); a frozen process cannot give
stacks, so /proc's word decides before anything asks for motion; a named busy peer and a
slow remote read explain a still stack, so they come before "still is hung"; dead-still
overrides the phase budget (a first save blocked on a dead mount would wait 30 minutes),
and any sign of life in a phase keeps it. "waiting" is a state, never a fault: rows P1, I1
and C1/C2 raise nothing of kind hang (C1 asks the arbiter to compare the ranks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class State(str, enum.Enum):
    """What a stalled rank is doing. Only ``hung``, ``dead_still`` and ``frozen`` are
    faults; ``undecided`` says why not (never a guess acted on)."""

    PROGRESSING = "progressing"
    WAITING_ON_PEER = "waiting_on_peer"
    WAITING_ON_IO = "waiting_on_io"
    BUSY = "busy"
    SPINNING = "spinning"
    DEAD_STILL = "dead_still"
    FROZEN = "frozen"
    HUNG = "hung"
    UNDECIDED = "undecided"


class Act(str, enum.Enum):
    NONE = "none"  # nothing to do: a budget still in force holds
    RECHECK = "recheck"  # not a hang now: suspect again ``recheck_in`` seconds later
    ASK = "ask"  # ask the arbiter to compare the ranks (a question, not a fault)
    DECLARE = "declare"  # raise the hang


HUNG_STATES = frozenset({State.HUNG, State.DEAD_STILL, State.FROZEN})
# the arbiter's flight-recorder rows (arbiter/fr_verdict.py) and the kind each one names
FR_KINDS = {"R1": "mismatch", "R2": "behind", "R3": "unresponsive", "R4": "stall",
            "R0": "none"}


@dataclass(frozen=True)
class Finding:
    """One thing the flight recorder's positions show in one process group (rows R1-R4,
    and ``waiting``: a rank behind in an outer group because it waits in an inner one)."""

    kind: str  # behind | mismatch | stall | unresponsive | waiting
    group: str
    ranks: tuple[int, ...]
    seq: int = -1
    op: str = ""
    message: str = ""


@dataclass(frozen=True)
class Verdict:
    """The one verdict on a stalled rank: what the agent does, what the status and the
    events say, and what the arbiter reads (``to_json``/``from_json``)."""

    state: State
    act: Act
    rule: str  # the table's row
    reason: str
    where: str | None = None  # the blocking frame (``open (save.py:12)``) or place
    culprits: tuple[int, ...] = ()  # ranks to blame (this rank when it hangs itself)
    waiting_on: int | None = None  # the busy peer this rank waits on
    waiting_for: str | None = None  # what the peer is busy in, or the remote I/O's target
    budget_seconds: float | None = None  # the budget this verdict was judged against
    budget_flag: str | None = None  # its flag (``--hang-io-timeout``)
    recheck_in: float | None = None  # seconds until the next look (act RECHECK)
    kill: bool = False  # the restart ends it with SIGKILL (a stopped process ignores TERM)
    missing: tuple[str, ...] = ()  # what could not be read
    # the arbiter's rows (R0-R4): every finding over the job's groups, and a mismatch's
    # place (group, #N, both calls): equal when the same mismatch recurs
    findings: tuple[Finding, ...] = ()
    key: str = ""

    @property
    def hung(self) -> bool:
        return self.state in HUNG_STATES

    @property
    def kind(self) -> str:
        """The flight recorder's finding for rows R0-R4, else the state's name."""
        return FR_KINDS.get(self.rule, self.state.value)

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state.value, "act": self.act.value, "rule": self.rule,
                "reason": self.reason, "where": self.where, "culprits": list(self.culprits),
                "waiting_on": self.waiting_on, "waiting_for": self.waiting_for,
                "budget_seconds": None if self.budget_seconds is None
                else round(self.budget_seconds, 3),
                "budget_flag": self.budget_flag,
                "recheck_in": None if self.recheck_in is None else round(self.recheck_in, 3),
                "kill": self.kill, "missing": list(self.missing)}

    @classmethod
    def from_json(cls, d: Any) -> Verdict:
        """A verdict a peer sent (untrusted): bounded, typed field by field; anything that
        does not parse is ``undecided`` with why, never a guess."""
        if not isinstance(d, dict):
            return undecided("U1", "the verdict is not an object")
        try:
            state, act = State(d.get("state")), Act(d.get("act", "none"))
        except ValueError:
            return undecided("U1", f"unknown verdict state {str(d.get('state'))[:40]!r}")
        culprits = d.get("culprits") or []
        if not isinstance(culprits, list) or len(culprits) > MAX_CULPRITS or not all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_RANK
                for r in culprits):
            return undecided("U1", "culprits are not a short list of ranks")
        waiting_on = d.get("waiting_on")
        if waiting_on is not None and not (isinstance(waiting_on, int) and
                                           not isinstance(waiting_on, bool) and
                                           0 <= waiting_on < MAX_RANK):
            return undecided("U1", "waiting_on is not a rank")
        budget = d.get("budget_seconds")
        recheck = d.get("recheck_in")
        missing = d.get("missing") or []
        return cls(state, act, _text(d.get("rule"), 8) or "?", _text(d.get("reason")) or "",
                   where=_text(d.get("where")), culprits=tuple(culprits),
                   waiting_on=waiting_on, waiting_for=_text(d.get("waiting_for")),
                   budget_seconds=_num(budget), budget_flag=_text(d.get("budget_flag"), 64),
                   recheck_in=_num(recheck), kill=d.get("kill") is True,
                   missing=tuple(_text(m) or "" for m in missing[:8])
                   if isinstance(missing, list) else ())


MAX_CULPRITS = 64
MAX_RANK = 1 << 20
MAX_TEXT = 300


def _text(v: Any, n: int = MAX_TEXT) -> str | None:
    return v[:n] if isinstance(v, str) else None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) > 1e9:
        return None
    return float(v)


def undecided(rule: str, why: str, *, recheck_in: float | None = None,
              missing: tuple[str, ...] = ()) -> Verdict:
    return Verdict(State.UNDECIDED, Act.RECHECK, rule, f"undecided: {why}",
                   recheck_in=recheck_in, missing=missing or (why,))


# ------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Budget:
    """The budget state of the stalled rank (from ``HangDetector`` and the flags)."""

    stalled_for: float  # seconds since the last step (or the trainer's start)
    step_budget: float
    spin_budget: float = 120.0  # learned at its place, else --hang-spin-timeout
    phase_timeout: float = 1800.0  # --hang-phase-timeout
    io_timeout: float = 300.0  # --hang-io-timeout
    dead_still_window: float = 60.0  # --hang-dead-still-window
    phase: str | None = None  # a declared phase open ("checkpoint"), or None
    phase_learned: bool = False  # its length was seen before
    first_step: bool = False  # no step yet this attempt
    declared: bool = False  # a hang was already raised for this stall
    rank: int | None = None
    recheck_every: float | None = None  # seconds between looks (None: the step budget)
    # the remote reads the stall's last verdict (row I1) saw and where, for row I3; empty
    # when that verdict was another row or I3 already granted its look
    last_io: tuple[Blocked, ...] = ()
    last_where: str | None = None


@dataclass(frozen=True)
class Blocked:
    """A thread blocked in a system call on a file descriptor (``agent/proc_wait.py``)."""

    pid: int
    tid: int
    syscall: str  # "read", "recvfrom", "openat", ... or "?"
    kind: str  # one of TARGET_KINDS
    target: str  # "tcp 127.0.0.1:41234", "/mnt/nfs/shard-3", "pipe:[1234]"


# remote: a socket whose far end is no peer of the job; peer: one that is; netfs: a file on
# a network mount; pipe: a pipe or queue (nothing outside the tree writes it); local: a
# local file, a unix socket, anything else
TARGET_KINDS = ("remote", "peer", "netfs", "pipe", "local")
IO_KINDS = frozenset({"remote", "netfs"})


@dataclass(frozen=True)
class Window:
    """What the samples over one window say (``agent/verify.py`` builds it)."""

    motion: str  # detect/liveness.judge: "alive", "spinning", "hung", "unknown"
    motion_reason: str = ""
    where: str | None = None  # the deciding thread's place
    by_io: bool = False  # alive by storage I/O alone
    in_collective: bool = False  # still, its innermost frames in a collective
    seconds: float = 0.0  # the window's span
    moved: bool | None = None  # any stack moved (None: no two stacked samples)
    cpu_seconds: float | None = None  # the tree's CPU over the window
    io_bytes: int | None = None  # the tree's storage bytes over the window
    all_blocked: bool = False  # every thread of every process off-CPU (S/D) in every sample
    stopped: tuple[str, ...] = ()  # processes stopped in every sample ("pid 7 (T, ...)")
    uninterruptible: tuple[str, ...] = ()  # processes in D in every sample
    blocked: tuple[Blocked, ...] = ()  # threads blocked in a syscall on an fd
    working_threads: int = 0  # threads whose stacks advance
    waits_on_peer: bool = False  # still in a rendezvous or store wait (peers not there yet)
    timed_wait: bool = False  # still in a sleep: it ends by itself
    errors: tuple[str, ...] = ()  # contradictions, /proc gone mid-read, a torn dump


@dataclass(frozen=True)
class Peers:
    """What the arbiter (or, without one, a local peer) relays about the other ranks."""

    busy_rank: int | None = None  # the rank this one waits on, judged busy
    busy_in: str | None = None  # what it is busy in (or the arbiter's words for the wait)
    arbiter: bool = False  # an arbiter can compare the ranks now
    asked_for: float | None = None  # seconds since this rank asked it (None: not asked)
    answer_wait: float = 20.0  # how long an open question holds the verdict


DEAD_CPU = 0.01  # cores: below this over the dead-still window nothing runs


def decide(budget: Budget, window: Window, peers: Peers | None = None, *,
           phase_check: bool = False) -> Verdict:
    """The verdict; see the module's table. ``phase_check``: the look taken inside a phase
    or before the first step (no step budget ran out): only rows U, F and D apply, and a
    sign of life is row D2 (act none: the phase budget holds)."""
    peers = peers or Peers()
    b, w = budget, window
    me = () if b.rank is None else (b.rank,)
    recheck = max(0.5, b.step_budget if b.recheck_every is None else b.recheck_every)
    soon = max(0.5, b.step_budget)  # a budgeted wait (I/O, a spin) is looked at each step
    if w.errors:
        if b.stalled_for >= b.phase_timeout:
            return Verdict(State.HUNG, Act.DECLARE, "U2",
                           f"no step for {b.stalled_for:.0f}s, past --hang-phase-timeout, and "
                           f"the evidence could not decide: {'; '.join(w.errors)[:200]}",
                           culprits=me, budget_seconds=b.phase_timeout,
                           budget_flag="--hang-phase-timeout", missing=w.errors)
        return undecided("U1", "; ".join(w.errors)[:MAX_TEXT], recheck_in=recheck,
                         missing=w.errors)
    if w.stopped:
        return Verdict(State.FROZEN, Act.DECLARE, "F1",
                       f"frozen: {'; '.join(w.stopped)[:200]} (stopped: it gives no stacks "
                       "and ignores SIGTERM)", where=w.stopped[0], culprits=me, kill=True)
    if w.uninterruptible and not w.io_bytes:
        return Verdict(State.FROZEN, Act.DECLARE, "F2",
                       f"frozen: {'; '.join(w.uninterruptible)[:200]} in uninterruptible "
                       f"sleep over {w.seconds:.1f}s, no I/O advancing", where=w.uninterruptible[0],
                       culprits=me, kill=True)
    if (not phase_check and w.in_collective and b.stalled_for < b.phase_timeout
            and (peers.busy_rank is not None or peers.busy_in is not None)):
        whom = (f"rank {peers.busy_rank} (busy in {peers.busy_in or '?'})"
                if peers.busy_rank is not None and not (peers.busy_in or "").startswith(
                    ("rank", "local rank")) else peers.busy_in)
        return Verdict(State.WAITING_ON_PEER, Act.RECHECK, "P1",
                       f"waiting on {whom} in {w.where}: a state, not a hang", where=w.where,
                       waiting_on=peers.busy_rank, waiting_for=peers.busy_in,
                       budget_seconds=b.phase_timeout, budget_flag="--hang-phase-timeout",
                       recheck_in=recheck)
    io = [t for t in w.blocked if t.kind in IO_KINDS]
    if io and w.working_threads == 0 and w.motion in ("hung", "unknown"):
        t = io[0]
        what = f"{t.syscall} on {t.target}"
        if b.stalled_for < b.io_timeout:
            return Verdict(State.WAITING_ON_IO, Act.RECHECK, "I1",
                           f"waiting on I/O: pid {t.pid} blocked in {what} for "
                           f"{b.stalled_for:.1f}s (budget --hang-io-timeout "
                           f"{b.io_timeout:.0f}s): not a hang", where=w.where,
                           waiting_for=what, budget_seconds=b.io_timeout,
                           budget_flag="--hang-io-timeout",
                           recheck_in=max(0.5, min(soon, b.io_timeout - b.stalled_for)))
        return Verdict(State.HUNG, Act.DECLARE, "I2",
                       f"blocked in {what} for {b.stalled_for:.0f}s, past --hang-io-timeout "
                       f"({b.io_timeout:.0f}s)", where=w.where, culprits=me,
                       waiting_for=what, budget_seconds=b.io_timeout,
                       budget_flag="--hang-io-timeout")
    if (b.last_io and not io and w.where != b.last_where and w.working_threads == 0
            and w.motion in ("hung", "unknown") and b.stalled_for < b.io_timeout):
        # the still samples before the read's end were the read's (seen: an 8 s read
        # ending 0.2 s before the verdict): one more look, not a hang on samples that
        # straddle it; a thread still stuck after it is judged on its own
        t = b.last_io[0]
        what = f"{t.syscall} on {t.target}"
        return Verdict(State.WAITING_ON_IO, Act.RECHECK, "I3",
                       f"waiting on I/O: the read ({what}) ended inside this window; one "
                       "more look before anything is called a hang", where=w.where,
                       waiting_for=what, budget_seconds=b.io_timeout,
                       budget_flag="--hang-io-timeout", recheck_in=soon)
    in_phase = b.phase is not None or b.first_step
    if phase_check or in_phase:
        if (w.seconds >= b.dead_still_window and w.all_blocked and w.moved is False
                and w.motion == "hung" and not w.io_bytes and w.cpu_seconds is not None
                and not (w.in_collective or w.waits_on_peer or w.timed_wait)
                and w.cpu_seconds <= DEAD_CPU * max(w.seconds, 1.0)):
            where = w.where or "an unknown frame"
            during = (f"the {b.phase} phase" if b.phase else "warm-up, before the first step")
            return Verdict(State.DEAD_STILL, Act.DECLARE, "D1",
                           f"dead-still in {during}: blocked in {where}, no CPU, no I/O, no "
                           f"stack movement for {w.seconds:.0f}s (--hang-dead-still-window)",
                           where=w.where, culprits=me, budget_seconds=b.dead_still_window,
                           budget_flag="--hang-dead-still-window")
        if phase_check:
            life = f"a sign of life in {b.phase or 'warm-up'}: {w.motion_reason}"
            return Verdict(_alive_state(w), Act.NONE, "D2", life[:MAX_TEXT], where=w.where)
    if w.motion == "alive" and not w.by_io:
        return Verdict(State.PROGRESSING, Act.RECHECK, "A1",
                       f"alive: {w.motion_reason}"[:MAX_TEXT], where=w.where, recheck_in=recheck)
    if w.motion == "alive":
        if b.stalled_for < b.phase_timeout:
            return Verdict(State.BUSY, Act.RECHECK, "A2",
                           f"busy with storage I/O: {w.motion_reason}"[:MAX_TEXT],
                           where=w.where, budget_seconds=b.phase_timeout,
                           budget_flag="--hang-phase-timeout", recheck_in=recheck)
        return Verdict(State.HUNG, Act.DECLARE, "A3",
                       f"doing storage I/O but no step for {b.stalled_for:.1f}s, over "
                       f"--hang-phase-timeout ({b.phase_timeout:.0f}s): {w.motion_reason}",
                       where=w.where, culprits=me, budget_seconds=b.phase_timeout,
                       budget_flag="--hang-phase-timeout")
    if w.motion == "spinning":
        if b.stalled_for < b.spin_budget:
            return Verdict(State.SPINNING, Act.RECHECK, "S1",
                           f"spinning in {w.where}: a hang if it still spins at "
                           f"{b.spin_budget:.0f}s; {w.motion_reason}"[:MAX_TEXT],
                           where=w.where, budget_seconds=b.spin_budget,
                           recheck_in=max(0.5, min(soon, b.spin_budget - b.stalled_for)))
        return Verdict(State.HUNG, Act.DECLARE, "S2",
                       f"spinning in {w.where} for {b.stalled_for:.1f}s, over the spin budget "
                       f"of {b.spin_budget:.0f}s (busy, but not progressing): "
                       f"{w.motion_reason}", where=w.where, culprits=me,
                       budget_seconds=b.spin_budget)
    if w.motion == "hung" and w.in_collective and peers.arbiter and not b.declared:
        if peers.asked_for is None:
            return Verdict(State.WAITING_ON_PEER, Act.ASK, "C1",
                           f"waiting in a collective for {b.stalled_for:.1f}s ({w.where}): a "
                           "hang only if no peer is busy; the arbiter compares the ranks",
                           where=w.where, recheck_in=recheck)
        if peers.asked_for < peers.answer_wait and peers.busy_in is None:
            return Verdict(State.WAITING_ON_PEER, Act.RECHECK, "C2",
                           f"waiting in {w.where}; the arbiter has not answered for "
                           f"{peers.asked_for:.1f}s (it decides within "
                           f"{peers.answer_wait:.0f}s)", where=w.where, recheck_in=recheck)
    if w.motion == "hung":
        return Verdict(State.HUNG, Act.DECLARE, "H1",
                       f"verified hung over {w.seconds:.1f}s: {w.motion_reason}",
                       where=w.where, culprits=me, budget_seconds=b.step_budget)
    return Verdict(State.HUNG, Act.DECLARE, "H2",
                   f"could not verify ({w.motion_reason or 'nothing readable'}): declared on "
                   "the budget alone", where=w.where, culprits=me,
                   budget_seconds=b.step_budget)


@dataclass(frozen=True)
class Ruling:
    """One look's verdict with the names the agent records it under, from one question to
    the policy (``ruling_of``): the verifier asked ``decide``, then ``label``, ``fault_message``
    and ``Verdict.to_json`` about the same verdict, four calls for one answer."""

    verdict: Verdict
    label: str  # ``label``: the verify event's kind, the fault's ``verdict``
    message: str  # ``fault_message``: the hang fault's message, should it be declared
    json: dict[str, Any]  # ``Verdict.to_json``: what the events and the arbiter read


def ruling_of(budget: Budget, window: Window, peers: Peers | None = None, *,
              budget_message: str) -> Ruling:
    """``decide`` and the verdict's names: ``budget_message`` is the detector's words for
    the budget that ran out ("no step progress for 2.0s ...")."""
    v = decide(budget, window, peers)
    return Ruling(v, label(v, window.motion), fault_message(v, budget_message), v.to_json())


def fault_message(v: Verdict, budget_message: str) -> str:
    """The hang fault's message, one form per row: the budget's words ("no progress for
    3.2s ...") then the reason; rows S2 and A3 name their own budget, so their reason
    stands alone ("spinning in f (file:line) for 31.0s, over the spin budget ...")."""
    return v.reason if v.rule in ("S2", "A3") else f"{budget_message}; {v.reason}"


def label(v: Verdict, motion: str) -> str:
    """The name a look is recorded under (the ``verify`` event's kind, the fault's
    ``verdict``, ``ftagent_hang_verifications_total{verdict}``): the motion (alive,
    spinning, hung, unknown) for rows A, S and H, whose names predate this table; the
    state for the rows the motion judge lacks (U, F, P, I, D, C)."""
    return motion if v.rule[:1] in ("A", "S", "H") else v.state.value


def peer_state(v: Verdict, motion: str) -> str:
    """The liveness state a rank's peers (the arbiter's BUSY judgement) read for it:
    ``motion`` (alive, spinning, hung, unknown), except that a rank waiting on remote I/O
    (rows I1, I3) is busy to them, alive, not hung: they wait on it (issue 35)."""
    return "alive" if v.state is State.WAITING_ON_IO else motion


def _alive_state(w: Window) -> State:
    if w.motion == "spinning":
        return State.SPINNING
    if w.motion == "alive":
        return State.BUSY if w.by_io else State.PROGRESSING
    return State.UNDECIDED


ROWS = ("U1", "U2", "F1", "F2", "P1", "I1", "I2", "I3", "D1", "D2", "A1", "A2", "A3", "S1",
        "S2", "C1", "C2", "H1", "H2")
FR_ROWS = ("R1", "R2", "R3", "R4", "R0")
__all__ = ["FR_KINDS", "FR_ROWS", "Act", "Blocked", "Budget", "Finding", "Peers", "ROWS",
           "Ruling", "State", "Verdict", "Window", "decide", "fault_message", "label",
           "peer_state", "ruling_of", "undecided"]
