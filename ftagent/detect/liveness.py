"""Suspect -> verify -> declare: is a stalled trainer hung, or busy in a phase nobody declared?

The hang detector's budget says when to *suspect* a hang. Before the agent acts, it samples
the trainer's process tree for a short window (``--hang-verify-window``, 2 s, several
samples: ``agent/verify.py``) and this module says whether those samples moved: a
``Motion``, one input of the stall policy (``detect/stall.decide``), whose ``Verdict`` is
the only verdict. Pure: samples in, motion out; no clock, no I/O.

Evidence per process of the tree, per sample: CPU seconds (user+system), storage I/O bytes,
and, from ``py-spy dump --json``, every Python thread's frames and whether the OS has it
running (py-spy's ``active``); per thread also its /proc state and CPU where readable.
GPU activity (NVML) may come with a sample; it is recorded, never decisive (below).

A thread, over the samples of the window, is one of:

* **parked** -- its stack did not move and it waits: the innermost frame is a known wait
  (``sleep``, ``wait``, ``acquire``, ``join``, ``recv``, ``select``/``poll``/``read``,
  ``all_reduce``/``barrier``/... and autograd's ``run_backward``, where DDP all-reduces),
  or py-spy says the OS is not running it (a ``with lock:`` shows only the ``with`` line);
* **waiting** -- its stack moves, but mostly between waits (a "waiting for data" retry loop
  that logs every second);
* **working** -- its stack moves and it mostly runs: frames or lines change between samples,
  not all within one function (an evaluation loop through the model's code); or its stack
  moves through frames that are not waits while the OS mostly finds it off-CPU and its
  process burns CPU (the same loop whose matmuls run in torch's intra-op pool, on a loaded
  machine: the thread sleeps at the pool's barrier, inside ``Linear.forward``);
* **spinning** -- it runs, but within one function at no more than ``spin_lines`` lines (a
  tight loop), or it runs at one still line with CPU advancing (a tight loop, or one long
  native call: the two look alike from outside) -- unless the locals of an *outer* frame
  change between samples: then the innermost call is made again and again (an evaluation
  loop whose time is all in ``Linear.forward``: every sample shows the same line), and the
  thread is **working**;
* **resumed** -- its stack sat still in a collective (``COLLECTIVE_WAIT`` in its innermost
  frames) from the first sample on and, in the last ones, holds no collective frame at all:
  the call returned, which a collective does only once every peer reached it, so the job
  moved. (A rank waiting on a peer's silent save leaves the all-reduce the instant the peer
  joins it: sampled then, its stack is out of the wait with no step line yet, and "moved
  only between waits" declared it hung a tenth of a second before its next step.) A loop
  that polls with a collective goes back into one and is judged as any wait loop. Its place
  is the wait it left.

Decision table (per process; the tree is alive if any process is, else spinning if any is,
else hung if any is, else unknown):

===================================================  ========  =========================
evidence                                             verdict   why
===================================================  ========  =========================
a thread working (frames move, or an outer frame's   alive     its code advances
  locals change while it runs at one line)
a thread resumed (left for good the collective it   alive     the collective returned:
  sat still in)                                                every peer reached it
a thread waiting, storage I/O >= ``io_busy`` B/s     alive     an I/O-bound phase (load)
storage I/O >= ``io_busy`` B/s, whatever the stack   alive     I/O is life: a silent save
  (spinning at one line, parked in a write)                      or scan whose bytes advance
                                                               (``by_io``; bounded by
                                                               --hang-phase-timeout)
a thread spinning                                    spinning  busy, but maybe forever
every thread parked or waiting, any CPU              hung      a still wait is a wait;
                                                               CPU in a wait frame is
                                                               busy polling (gloo, NCCL)
still running stack, no CPU advancing                hung      the "running" flag is stale
no stacks (py-spy absent/denied/failed), CPU         alive     CPU is all there is
  >= ``busy_cores``
no stacks, CPU < ``idle_cores``                      hung      nothing runs
no stacks, CPU in between; nothing readable          unknown   the agent falls back to
                                                               the budget: a hang
one stack sample only: waiting shape                 hung      (with any CPU, as above)
one stack sample only: running and CPU >= busy       alive
===================================================  ========  =========================

What the agent does with it (``agent/verify.py``): alive -> the stall is an undeclared long
phase, not a fault; it is re-checked a budget later and, when steps resume, learned
(``PhaseBook``); hung or unknown -> the HANG fault is raised, with this verdict as evidence;
spinning -> like alive until the stall has lasted the spin budget (what was learned at that
place, else ``--hang-spin-timeout``), then a hang "spinning in f (file:line)".

How each signal lies, and what is done about it:

* **CPU time** -- a rank blocked in a gloo/NCCL collective can burn a core busy-polling, so
  CPU alone in a wait frame is not life (the wait frame wins). A rank can also burn CPU in
  a thread that is not the trainer's (a log shipper): any working thread counts as life, so
  a hung main thread beside a truly working thread is seen as alive until that thread
  stops (re-checked every budget).
* **py-spy's idle flag** -- a thread whose compute runs in torch's intra-op pool sleeps at
  the pool's barrier, and on a loaded machine py-spy finds it idle in most samples though
  its stack moves through the model: with CPU burning in the process and in the thread
  itself, off-CPU outside wait frames is work (``_computing``). The blind spot this
  leaves: a polling loop that sleeps in a frame not named as a wait, beside a native
  thread spinning in the same process (an NCCL proxy), reads as working; it is re-checked
  every budget like any undeclared phase.
* **Stacks** -- py-spy sees Python frames only: a long native call (a huge matmul, a
  compile) sits at one line like a tight loop (hence *spinning*, not hung); a loop that
  spends its time in one native call shows the same frames in every sample (hence the
  locals of the outer frames: its counter moves); a thread blocked on a lock shows the
  ``with`` line, not ``acquire`` (hence py-spy's idle flag). Locals can lie too: a freed
  object's address may be reused, so unchanged locals prove nothing (spinning, at worst).
  py-spy may be absent, denied ptrace, or time out: the verdict then rests on CPU and says
  so.
* **GPU** -- an NCCL kernel spinning in a hung collective keeps a GPU at 100 %: GPU busy
  alone is never life; it is recorded beside the verdict.
* **I/O counters** -- a chatty logger writes bytes while hung: only storage bytes
  (``read_bytes``/``write_bytes``, not pipes or sockets) at ``io_busy`` or more count. A
  checkpoint save sits at one line in native code (``torch.save``: *spinning*) or parked
  in a write; with its bytes advancing it is alive (``by_io``), for as long as they
  advance, and the agent bounds it by ``--hang-phase-timeout``. A save whose bytes stopped
  (a dead mount) with a still stack is a hang, as before. Writes to a tmpfs reach no
  storage layer and do not count.
* **The tree** -- processes exit and fork while sampled: a process seen in fewer than two
  samples gives no motion; it is reported, and the verdict rests on the others.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    SPINNING = "spinning"
    HUNG = "hung"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Frame:
    name: str
    file: str  # short file name (py-spy's short_filename)
    line: int
    lib: bool = False  # in an installed library (site-packages, the standard library)

    def text(self) -> str:
        return f"{self.name} ({self.file}:{self.line})"


@dataclass(frozen=True)
class ThreadSample:
    tid: int  # OS thread id where known, else py-spy's thread id
    name: str
    active: bool | None  # py-spy: the OS has the thread running (None: not known)
    frames: tuple[Frame, ...]  # innermost first
    cpu: float | None = None  # this thread's CPU seconds at the sample, if readable
    state: str | None = None  # /proc state letter: R running, S sleeping, D disk, ...
    # per frame (innermost first), a checksum of its local variables' reprs (py-spy
    # --locals): a frame at the same line whose locals change has run on (a loop's counter,
    # a new tensor per call); None where not known
    locals: tuple[int | None, ...] | None = None


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    ts: float
    cpu: float | None  # user + system seconds; None when unreadable
    io: int | None = None  # storage read_bytes + write_bytes; None when unreadable
    threads: tuple[ThreadSample, ...] | None = None  # None: no stacks this sample
    status: str | None = None  # psutil's status
    errors: tuple[str, ...] = ()  # what could not be read, in words
    gone: bool = False  # the process had exited


@dataclass(frozen=True)
class GpuSample:
    """Activity of the trainer's GPUs (NVML). Never decisive: see the module docstring."""

    utilization: float | None = None  # percent, highest over the GPUs
    memory_utilization: float | None = None


@dataclass(frozen=True)
class Snapshot:
    ts: float
    processes: tuple[ProcessSample, ...]
    gpu: GpuSample | None = None
    errors: tuple[str, ...] = ()  # about the whole sample (the tree could not be listed)


@dataclass(frozen=True)
class Thresholds:
    busy_cores: float = 0.25  # CPU of a working process without stacks (cores)
    idle_cores: float = 0.05  # below this nothing runs
    io_busy: float = 1 << 20  # storage bytes/s of an I/O-bound phase
    spin_lines: int = 3  # a running thread within one function at this few lines spins


# Innermost frames of a thread that waits: for time, a lock, a peer, a file descriptor.
WAIT_FRAME = re.compile(
    r"(?:^|[.:])_?(?:sleep|wait\w*|acquire|join|recv\w*|accept|select|poll|epoll|read|"
    r"readline|readinto|get|put|barrier|monitored_barrier|all_?reduce\w*|all_?gather\w*|"
    r"reduce_?scatter\w*|broadcast\w*|all_?to_?all\w*|gather|scatter|send|isend|irecv|"
    r"synchronize|_engine_run_backward|run_backward|_wait_for_tstate_lock|rendezvous)$",
    re.I)

THREAD_STATES = ("parked", "waiting", "working", "resumed", "spinning", "unsure")


def waits(frame: Frame | None) -> bool:
    return frame is not None and bool(WAIT_FRAME.search(frame.name))


# --------------------------------------------------------------------------- places


@dataclass(frozen=True)
class Place:
    """Where a stall runs: the frames every sample shared, outermost first. The innermost
    of them is compared by function only (a loop moves through its lines)."""

    frames: tuple[Frame, ...]  # outermost first; the last one's line is the one seen most

    def matches(self, stack: Sequence[Frame]) -> bool:
        """Is a stack (innermost first) running in this place?"""
        outer = list(reversed(stack))
        if not self.frames or len(outer) < len(self.frames):
            return False
        *head, last = self.frames
        for a, b in zip(head, outer, strict=False):
            if (a.name, a.file, a.line) != (b.name, b.file, b.line):
                return False
        b = outer[len(head)]
        return (last.name, last.file) == (b.name, b.file)

    @property
    def key(self) -> tuple[tuple[str, str, int | None], ...]:
        *head, last = self.frames
        return tuple((f.name, f.file, f.line) for f in head) + ((last.name, last.file, None),)

    def where(self) -> str:
        """``evaluate (train.py:88)``; a library frame says which user code called it."""
        inner = self.frames[-1]
        text = inner.text()
        if inner.lib:
            user = next((f for f in reversed(self.frames[:-1]) if not f.lib), None)
            if user is not None:
                text += f" from {user.text()}"
        return text


def place_of(stacks: Sequence[Sequence[Frame]], moving: bool | None = None) -> Place | None:
    """The common place of several stacks (innermost first) of one thread: the frames all
    share, outermost first; for a moving stack down to the deepest frame of user code."""
    stacks = [s for s in stacks if s]
    if not stacks:
        return None
    outers = [list(reversed(s)) for s in stacks]
    common: list[Frame] = []
    for depth in range(min(len(o) for o in outers)):
        here = [o[depth] for o in outers]
        first = here[0]
        if all((f.name, f.file, f.line) == (first.name, first.file, first.line) for f in here):
            common.append(first)
            continue
        if all((f.name, f.file) == (first.name, first.file) for f in here):
            line = Counter(f.line for f in here).most_common(1)[0][0]
            common.append(Frame(first.name, first.file, line, first.lib))
        break
    if moving or (moving is None and len(set(map(tuple, stacks))) > 1):
        # a moving stack: its place is the user's code it moves in (a later sample may be
        # anywhere in evaluate, not in the library call this window happened to see)
        while len(common) > 1 and common[-1].lib:
            common.pop()
    return Place(tuple(common)) if common else None


# --------------------------------------------------------------------------- motion


@dataclass(frozen=True)
class ThreadMotion:
    tid: int
    name: str
    state: str  # one of THREAD_STATES
    samples: int
    moved: bool
    where: str | None
    place: Place | None = None
    running_samples: int = 0


@dataclass(frozen=True)
class ProcessMotion:
    pid: int
    state: Liveness
    reason: str
    samples: int = 0
    stack_samples: int = 0
    cpu_seconds: float | None = None
    cpu_cores: float | None = None
    io_bytes_per_second: float | None = None
    threads: tuple[ThreadMotion, ...] = ()
    place: Place | None = None
    where: str | None = None
    missing: tuple[str, ...] = ()
    by_io: bool = False  # alive only because its storage I/O advances (a silent save)


@dataclass(frozen=True)
class Motion:
    """What a window's samples say about motion (alive, spinning, still): evidence the
    stall policy reads (``agent/stall_window.window_of``), not a verdict of its own."""

    state: Liveness
    reason: str
    where: str | None = None
    place: Place | None = None
    processes: tuple[ProcessMotion, ...] = ()
    missing: tuple[str, ...] = ()
    window_seconds: float = 0.0
    samples: int = 0
    cpu_seconds: float | None = None  # the whole tree's, over the window
    gpu: GpuSample | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    by_io: bool = False  # alive only because storage I/O advances (ProcessMotion.by_io)
    # hung, its still thread waiting in a collective (``in_collective``): judged with the
    # verdict, read as a field (the stall window asked a function about it per verdict)
    in_collective: bool = False

    def to_json(self) -> dict[str, Any]:
        """The verdict as fault evidence / the stacks JSON the arbiter reads."""
        return {
            "state": self.state.value,
            "reason": self.reason,
            "where": self.where,
            "window_seconds": round(self.window_seconds, 3),
            "samples": self.samples,
            "cpu_seconds": None if self.cpu_seconds is None else round(self.cpu_seconds, 3),
            "by_io": self.by_io,
            "missing": list(self.missing),
            "gpu": None if self.gpu is None else {
                "utilization": self.gpu.utilization,
                "memory_utilization": self.gpu.memory_utilization},
            "processes": [{
                "pid": p.pid, "state": p.state.value, "reason": p.reason,
                "samples": p.samples, "stack_samples": p.stack_samples,
                "cpu_seconds": None if p.cpu_seconds is None else round(p.cpu_seconds, 3),
                "cpu_cores": None if p.cpu_cores is None else round(p.cpu_cores, 3),
                "io_bytes_per_second": None if p.io_bytes_per_second is None
                else round(p.io_bytes_per_second),
                "where": p.where,
                "threads": [{"tid": t.tid, "name": t.name, "state": t.state,
                             "moved": t.moved, "samples": t.samples, "where": t.where}
                            for t in p.threads],
                "missing": list(p.missing)} for p in self.processes],
            **self.extra,
        }


def judge(snapshots: Sequence[Snapshot], th: Thresholds | None = None) -> Motion:
    """The verdict over a verification window's snapshots (in time order)."""
    th = th or Thresholds()
    snaps = sorted(snapshots, key=lambda s: s.ts)
    if not snaps:
        return Motion(Liveness.UNKNOWN, "no evidence: nothing was sampled",
                       missing=("no samples",))
    window = snaps[-1].ts - snaps[0].ts
    by_pid: OrderedDict[int, list[ProcessSample]] = OrderedDict()
    for s in snaps:
        for p in s.processes:
            by_pid.setdefault(p.pid, []).append(p)
    missing: list[str] = [e for s in snaps for e in s.errors]
    verdicts = [judge_process(pid, samples, th) for pid, samples in by_pid.items()]
    for v in verdicts:
        missing += [f"pid {v.pid}: {m}" for m in v.missing]
    missing = list(dict.fromkeys(missing))
    cpu = [v.cpu_seconds for v in verdicts if v.cpu_seconds is not None]
    gpu = next((s.gpu for s in reversed(snaps) if s.gpu is not None), None)
    base = Motion(Liveness.UNKNOWN, "", processes=tuple(verdicts), missing=tuple(missing),
                   window_seconds=window, samples=len(snaps),
                   cpu_seconds=sum(cpu) if cpu else None, gpu=gpu)
    if not verdicts:
        return dataclasses.replace(base, reason="no evidence: the trainer's tree was empty")
    for state in (Liveness.ALIVE, Liveness.SPINNING, Liveness.HUNG):
        deciding = [v for v in verdicts if v.state is state]
        if deciding:
            d = deciding[0]
            reason = f"pid {d.pid}: {d.reason}"
            others = len(verdicts) - 1
            if others:
                counts = Counter(v.state.value for v in verdicts if v is not d)
                reason += "; other processes: " + ", ".join(
                    f"{n} {s}" for s, n in sorted(counts.items()))
            if state is Liveness.HUNG and gpu is not None and (gpu.utilization or 0) > 0:
                reason += (f"; GPU {gpu.utilization:g}% busy (not life: a kernel spinning in "
                           "a hung collective is busy too)")
            got = dataclasses.replace(base, state=state, reason=reason, where=d.where,
                                      place=d.place, by_io=d.by_io)
            if state is Liveness.HUNG and in_collective(got):
                got = dataclasses.replace(got, in_collective=True)
            return got
    return dataclasses.replace(base, reason="no usable evidence: " + (
        "; ".join(missing) or "nothing readable"))


def judge_process(pid: int, samples: Sequence[ProcessSample],
                  th: Thresholds | None = None) -> ProcessMotion:
    th = th or Thresholds()
    present = [s for s in samples if not s.gone]
    missing = list(dict.fromkeys(e for s in samples for e in s.errors))
    if len(present) < len(samples):
        missing.append(f"exited during the window (seen in {len(present)}/{len(samples)} "
                       "samples)")
    if not present:
        return ProcessMotion(pid, Liveness.UNKNOWN, "exited before it could be sampled",
                              samples=0, missing=tuple(missing))
    cpu_s, cores = _rate([(s.ts, s.cpu) for s in present])
    _, io_rate = _rate([(s.ts, s.io) for s in present])
    stacked = [s for s in present if s.threads is not None]
    base = ProcessMotion(pid, Liveness.UNKNOWN, "", samples=len(present),
                          stack_samples=len(stacked), cpu_seconds=cpu_s, cpu_cores=cores,
                          io_bytes_per_second=io_rate, missing=tuple(missing))

    def out(state: Liveness, reason: str, t: ThreadMotion | None = None,
            threads: Sequence[ThreadMotion] = ()) -> ProcessMotion:
        return dataclasses.replace(base, state=state, reason=reason, threads=tuple(threads),
                                   place=t.place if t else None, where=t.where if t else None,
                                   missing=tuple(missing))

    cpu_text = _cpu_text(cpu_s, cores, present)
    if len(stacked) < 2:
        if not stacked:
            missing.append("no stacks" if not any("py-spy" in m for m in missing)
                           else "no stacks (py-spy)")
        else:
            missing.append("one stack sample only: motion not seen")
        state, reason, place = _without_motion(stacked, cores, th, cpu_text)
        by_io = io_rate is not None and io_rate >= th.io_busy and state is not Liveness.ALIVE
        if by_io:  # I/O is life, with or without stacks to see
            state, reason = Liveness.ALIVE, (
                f"storage I/O advancing at {(io_rate or 0) / 2**20:.1f} MiB/s ({reason}): a "
                "save or a scan, alive while its bytes advance")
        return dataclasses.replace(base, state=state, reason=reason, place=place,
                                   where=place.where() if place else None,
                                   missing=tuple(missing), by_io=by_io)
    threads = _threads(stacked, th, cores)
    order = {"working": 0, "resumed": 0, "waiting": 1, "spinning": 2, "parked": 3, "unsure": 4}
    main = _main_first(threads)
    working = [t for t in main if t.state == "working"]
    io_busy = io_rate is not None and io_rate >= th.io_busy
    if working:
        t = working[0]
        how = "stack moved" if t.moved else "same frames, but its callers' locals moved"
        return out(Liveness.ALIVE, f"{_tname(t)} working ({how}; running in "
                   f"{t.running_samples}/{t.samples} samples) in {t.where}, {cpu_text}",
                   t, threads)
    resumed = [t for t in main if t.state == "resumed"]
    if resumed:
        t = resumed[0]
        return out(Liveness.ALIVE, f"{_tname(t)} left the collective it waited in "
                   f"({t.where}): the collective returned, so every peer reached it; "
                   f"{cpu_text}", t, threads)
    waiting = [t for t in main if t.state == "waiting"]
    if waiting and io_busy:
        t = waiting[0]
        return dataclasses.replace(out(
            Liveness.ALIVE, f"storage I/O advancing at {(io_rate or 0) / 2**20:.1f} MiB/s "
            f"while {_tname(t)} moves between waits in {t.where}, {cpu_text}", t, threads),
            by_io=True)
    if io_busy and main:
        # I/O is life: a save in native code (one still line, CPU burning) or parked in a
        # write, a scan between reads, while its storage bytes advance
        t = next((x for x in main if x.state == "spinning"), main[0])
        return dataclasses.replace(out(
            Liveness.ALIVE, f"storage I/O advancing at {(io_rate or 0) / 2**20:.1f} MiB/s "
            f"while {_tname(t)} is {t.state} in {t.where}, {cpu_text}: a save or a scan, "
            "alive while its bytes advance", t, threads), by_io=True)
    spinning = [t for t in main if t.state == "spinning"]
    if spinning:
        t = spinning[0]
        how = "at one line" if not t.moved else "within one function"
        return out(Liveness.SPINNING, f"{_tname(t)} spinning {how} in {t.where}, "
                   f"{cpu_text}", t, threads)
    still = sorted(main, key=lambda t: order[t.state])
    if not still:
        return out(Liveness.UNKNOWN, "no Python threads in the stacks")
    t = still[0] if still[0].state != "unsure" else main[0]
    if t.state == "parked":
        how = f"parked in {t.where}: its stack did not move in {t.samples} samples"
    elif t.state == "waiting":
        how = (f"waiting in {t.where}: its stack moved only between waits "
               f"({t.samples - t.running_samples}/{t.samples} samples waiting)")
    else:
        how = f"in {t.where}"
    if cores is not None and cores >= th.idle_cores:
        cpu_text += " (CPU in a wait is busy polling, not work)"
    elif cores is not None:
        cpu_text += ": CPU did not advance"
    return out(Liveness.HUNG, f"{_tname(t)} {how}, {cpu_text}", t, threads)


def _without_motion(stacked: Sequence[ProcessSample], cores: float | None, th: Thresholds,
                    cpu_text: str) -> tuple[Liveness, str, Place | None]:
    """No motion to see (0 or 1 stack sample): CPU, vetoed by a wait-shaped stack."""
    place = None
    shape = ""
    if stacked:
        threads = _main_first_samples(stacked[0].threads or ())
        if threads:
            t = threads[0]
            place = Place(tuple(reversed(t.frames))) if t.frames else None
            inner = t.frames[0] if t.frames else None
            if waits(inner) or t.active is False:
                what = inner.text() if inner else "no frame"
                return Liveness.HUNG, (f"{t.name!r} in a wait ({what}) in the one stack "
                                       f"sample, {cpu_text}"), place
            shape = f", stack in {inner.text() if inner else '?'}"
    if cores is None:
        return Liveness.UNKNOWN, "no evidence: neither CPU time nor stacks readable", place
    if cores >= th.busy_cores:
        return Liveness.ALIVE, f"{cpu_text} (stacks unavailable: CPU alone){shape}", place
    if cores < th.idle_cores:
        return Liveness.HUNG, f"{cpu_text}: CPU did not advance (stacks unavailable)", place
    return Liveness.UNKNOWN, f"{cpu_text}: neither busy nor idle, and no stacks", place


AGENT_THREAD_PREFIX = "ftagent-"  # threads the agent itself runs inside the trainer
AGENT_THREAD_FRAMES = frozenset({("_serve", "sitecustomize.py"), ("_serve", "fr_boot.py")})


def agent_thread(t: ThreadSample) -> bool:
    """A thread the agent put in the trainer (the flight-recorder trigger, which runs the
    very dump the verification asked for): its work is the agent's, never the trainer's
    life. Known by its name, or by its frames where py-spy gave no name."""
    if t.name.startswith(AGENT_THREAD_PREFIX):
        return True
    return any((f.name, f.file) in AGENT_THREAD_FRAMES for f in t.frames)


def _threads(stacked: Sequence[ProcessSample], th: Thresholds,
             cores: float | None) -> list[ThreadMotion]:
    series: OrderedDict[int, list[ThreadSample]] = OrderedDict()
    times: dict[int, list[float]] = {}
    for s in stacked:
        for t in s.threads or ():
            if agent_thread(t):
                continue
            series.setdefault(t.tid, []).append(t)
            times.setdefault(t.tid, []).append(s.ts)
    out = []
    for tid, ts in series.items():
        out.append(_thread(tid, ts, th, cores, times[tid]))
    return out


def _thread(tid: int, ts: Sequence[ThreadSample], th: Thresholds,
            cores: float | None, at: Sequence[float] | None = None) -> ThreadMotion:
    name = ts[-1].name
    stacks = [t.frames for t in ts]
    place = place_of(stacks)
    distinct = set(stacks)
    moved = len(distinct) > 1
    wait_flags = [waits(t.frames[0] if t.frames else None) or t.active is False for t in ts]
    running = sum(1 for w in wait_flags if not w)
    where = place.where() if place else (ts[-1].frames[0].text() if ts[-1].frames else None)
    if len(ts) < 2:
        return ThreadMotion(tid, name, "unsure", len(ts), moved, where, place, running)
    left = _left_collective(stacks)
    if left is not None:
        return ThreadMotion(tid, name, "resumed", len(ts), True, left.where(), left, running)
    cpu_t, _ = _rate([(i, t.cpu) for i, t in enumerate(ts)])
    burning = (cpu_t is not None and cpu_t > 0) if cpu_t is not None else (
        cores is not None and cores >= th.idle_cores)
    outer_ran = _outer_locals_changed(ts)
    if not moved:
        if all(wait_flags) or not burning:
            state = "parked"
        else:
            state = "working" if outer_ran else "spinning"
            if outer_ran:
                place = place_of(stacks, moving=True)
                where = place.where() if place else where
    elif running * 2 <= len(ts):
        state = "working" if _computing(ts, th, cores, at) else "waiting"
    else:
        inner = {(s[0].name, s[0].file) for s in stacks if s}
        outer = {s[1:] for s in stacks}
        lines = {s[0].line for s in stacks if s}
        if len(inner) == 1 and len(outer) == 1 and len(lines) <= th.spin_lines and \
                not outer_ran:
            state = "spinning"
            fr = stacks[-1][0]
            where = f"{fr.name} ({fr.file}:{','.join(str(n) for n in sorted(lines))})"
        else:
            state = "working"
    return ThreadMotion(tid, name, state, len(ts), moved, where, place, running)


def _left_collective(stacks: Sequence[tuple[Frame, ...]]) -> Place | None:
    """The place of the collective wait a thread's stacks (in time order, innermost first)
    left for good: from the first sample up to some point one still stack waiting in a
    collective (``COLLECTIVE_WAIT`` in its innermost frames: one call, parked), from there
    to the last none with a collective frame anywhere -- the call returned rather than
    going deeper into it (a backward hook under ``run_backward`` still holds that frame).
    A loop that polls with a collective re-enters one and is not this (it is judged as
    any wait loop). None when the stacks show no such exit."""
    first = stacks[0] if stacks else ()
    if not any(COLLECTIVE_WAIT.search(f.text()) for f in first[:3]):
        return None
    k = next((i for i, s in enumerate(stacks) if s != first), len(stacks))
    if k == len(stacks) or not all(stacks[k:]):
        return None  # still there, or a sample without frames: nothing seen leaving
    if any(COLLECTIVE_WAIT.search(f.text()) for s in stacks[k:] for f in s):
        return None
    return place_of(stacks[:k], moving=False)


def _computing(ts: Sequence[ThreadSample], th: Thresholds, cores: float | None,
               at: Sequence[float] | None) -> bool:
    """A moving stack the OS mostly finds off-CPU, yet not in a wait frame: compute the
    thread hands to a pool and waits on (torch's intra-op threads under a loaded machine:
    the OMP master sleeps at its barrier inside ``Linear.forward``). It is working when
    most samples are outside a wait frame, its process burns ``busy_cores`` and the thread
    itself at least ``idle_cores`` -- a retry loop that sleeps in a frame not named as a
    wait uses next to no CPU of its own, and busy polling shows a wait frame."""
    declared = sum(1 for t in ts if waits(t.frames[0] if t.frames else None))
    if declared * 2 > len(ts) or cores is None or cores < th.busy_cores:
        return False
    own = None
    if at is not None:
        _, own = _rate(list(zip(at, (t.cpu for t in ts), strict=True)))
    return own is None or own >= th.idle_cores


def _outer_locals_changed(ts: Sequence[ThreadSample]) -> bool:
    """Did the locals of a frame other than the innermost change while the frames stayed
    the same? (The innermost call is then made again and again: a loop one level up.)"""
    first = ts[0]
    if first.locals is None or len(first.frames) < 2:
        return False
    for t in ts[1:]:
        if t.locals is None or t.frames[1:] != first.frames[1:]:
            continue
        for a, b in zip(first.locals[1:], t.locals[1:], strict=False):
            if a is not None and b is not None and a != b:
                return True
    return False


def _main_first(threads: Iterable[ThreadMotion]) -> list[ThreadMotion]:
    return sorted(threads, key=lambda t: t.name != "MainThread")


def _main_first_samples(threads: Iterable[ThreadSample]) -> list[ThreadSample]:
    return sorted((t for t in threads if not agent_thread(t)),
                  key=lambda t: t.name != "MainThread")


def _tname(t: ThreadMotion) -> str:
    return repr(t.name) if t.name else f"thread {t.tid}"


def _rate(points: Sequence[tuple[float, float | int | None]]
          ) -> tuple[float | None, float | None]:
    """(delta, delta per second) between the first and last known values."""
    known = [(t, v) for t, v in points if v is not None]
    if len(known) < 2:
        return None, None
    (t0, v0), (t1, v1) = known[0], known[-1]
    delta = max(0.0, float(v1) - float(v0))
    return delta, (delta / (t1 - t0) if t1 > t0 else None)


def _cpu_text(cpu_s: float | None, cores: float | None,
              present: Sequence[ProcessSample]) -> str:
    if cpu_s is None:
        return "CPU time unreadable"
    span = present[-1].ts - present[0].ts
    return f"CPU {cpu_s:.2f}s in {span:.1f}s ({(cores or 0) * 100:.0f}% of a core)"


# --------------------------------------------------------------------------- what to do

# Where a rank waits for its peers: a torch.distributed collective, DDP's all-reduce
# inside autograd's backward, a barrier. A hung verdict here may be a victim of a peer
# busy elsewhere (waiting is not hanging: agent/peer_wait.py asks the arbiter first).
COLLECTIVE_WAIT = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|\bbarrier|"
    r"_engine_run_backward|run_backward|finalize_backward|\b(?:i?send|i?recv)\b|"
    r"\bwait\w* \((?:distributed_c10d|c10d_logger|_functional_collectives)\.py:", re.I)


def in_collective(verdict: Motion) -> bool:
    """A hung verdict whose still thread waits in a collective (its innermost frames)."""
    if verdict.state is not Liveness.HUNG:
        return False
    frames = verdict.place.frames[-3:] if verdict.place is not None else ()
    return any(COLLECTIVE_WAIT.search(f.text()) for f in frames) or bool(
        verdict.where and COLLECTIVE_WAIT.search(verdict.where.split(" from ")[0]))



# --------------------------------------------------------------------------- learning


@dataclass
class Learned:
    """An undeclared long phase: where it ran, how long it took at most, how often seen."""

    place: Place | None
    where: str
    longest: float
    count: int = 1
    last_step: int | None = None
    steps: list[int] = field(default_factory=list)


class PhaseBook:
    """Undeclared phases learned from verified-alive stalls, at most ``max_places`` (the
    least recently seen is forgotten: the ``where`` label of the metric stays bounded)."""

    def __init__(self, max_places: int = 8, margin: float = 2.0) -> None:
        self.max_places = max_places
        self.margin = margin
        self.places: OrderedDict[tuple[Any, ...], Learned] = OrderedDict()

    def learn(self, place: Place | None, where: str | None, seconds: float,
              step: int | None) -> tuple[Learned, list[Learned]]:
        """Record a stall that ended (steps resumed); returns it and the forgotten ones."""
        key: tuple[Any, ...] = place.key if place is not None else ("?", where or "")
        got = self.places.pop(key, None)
        if got is None:
            got = Learned(place, where or (place.where() if place else "an unknown place"),
                          seconds)
        else:
            got.count += 1
            got.longest = max(got.longest, seconds)
        got.last_step = step
        if step is not None:
            got.steps = (got.steps + [step])[-8:]
        self.places[key] = got
        evicted = []
        while len(self.places) > self.max_places:
            evicted.append(self.places.popitem(last=False)[1])
        return got, evicted

    def match(self, stacks: Iterable[Sequence[Frame]]) -> Learned | None:
        """The learned phase one of these stacks (innermost first) runs in, if any."""
        stacks = list(stacks)
        for got in reversed(self.places.values()):
            if got.place is not None and any(got.place.matches(s) for s in stacks):
                return got
        return None

    def at(self, place: Place | None) -> Learned | None:
        if place is None:
            return None
        return self.places.get(place.key)

    def budget(self, got: Learned, floor: float) -> float:
        """Seconds from the stall's start before it is suspected again."""
        return max(floor, self.margin * got.longest)


def stacks_of(snapshot: Snapshot) -> list[tuple[Frame, ...]]:
    return [t.frames for p in snapshot.processes for t in (p.threads or ()) if t.frames]


# --------------------------------------------------------------------------- recorded evidence


def snapshot_to_json(s: Snapshot) -> dict[str, Any]:
    """A snapshot as plain JSON (recorded evidence for tests, the events file)."""
    return {"ts": s.ts, "errors": list(s.errors),
            "gpu": None if s.gpu is None else dataclasses.asdict(s.gpu),
            "processes": [{
                "pid": p.pid, "ts": p.ts, "cpu": p.cpu, "io": p.io, "status": p.status,
                "errors": list(p.errors), "gone": p.gone,
                "threads": None if p.threads is None else [{
                    "tid": t.tid, "name": t.name, "active": t.active, "cpu": t.cpu,
                    "state": t.state, "locals": None if t.locals is None else list(t.locals),
                    "frames": [[f.name, f.file, f.line, f.lib] for f in t.frames]}
                    for t in p.threads]} for p in s.processes]}


def snapshot_from_json(d: dict[str, Any]) -> Snapshot:
    gpu = d.get("gpu")
    return Snapshot(
        ts=float(d["ts"]), errors=tuple(d.get("errors") or ()),
        gpu=GpuSample(**gpu) if isinstance(gpu, dict) else None,
        processes=tuple(ProcessSample(
            pid=int(p["pid"]), ts=float(p["ts"]), cpu=p.get("cpu"), io=p.get("io"),
            status=p.get("status"), errors=tuple(p.get("errors") or ()),
            gone=bool(p.get("gone")),
            threads=None if p.get("threads") is None else tuple(ThreadSample(
                tid=int(t["tid"]), name=str(t["name"]), active=t.get("active"),
                cpu=t.get("cpu"), state=t.get("state"),
                locals=None if t.get("locals") is None else tuple(t["locals"]),
                frames=tuple(Frame(str(f[0]), str(f[1]), int(f[2]), bool(f[3]))
                             for f in t["frames"])) for t in p["threads"]))
            for p in d["processes"]))
