"""Limits on every value a peer, a log line or the SDK hands us, in one place.

Both sides of the wire check the same numbers: the agent before it sends (so a trainer
that prints step 10**30 cannot make its own reports unsendable), the arbiter where a
message enters (so one hostile Hello cannot break the listing of every job). A value out
of range is refused with a message that names the field and the range; it never becomes
state. Values are chosen far above anything real and far below what breaks a type:

* steps, samples, tokens: < 2**53, so they survive a float (JSON, Prometheus) exactly;
* generations and restart counts: < 2**31, far from int64's edge even after +1; a peer
  may raise a job's generation only to MAX_CLAIMED_GENERATION (2**30 - 1), so the
  generations the arbiter makes itself keep 2**30 of headroom below MAX_GENERATION
  (a restart a second for 34 years) and no Hello can push a job to the ceiling;
* world size: 1..1,000,000 ranks;
* names (job, namespace, pod, node, phase, op): short printable strings.
* phase and op names as label values: the first MAX_PHASES / MAX_OPS distinct ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

MAX_STEP = 2**53 - 1  # steps, samples and tokens: exact in a float64
MAX_GENERATION = 2**31 - 1
MAX_CLAIMED_GENERATION = 2**30 - 1  # the highest a peer may raise a job's generation to
MAX_RESTARTS = 2**31 - 1
MAX_WORLD_SIZE = 1_000_000
MAX_NAME = 253  # a Kubernetes object name (DNS subdomain); jobs, pods, nodes
MAX_LABEL_NAME = 64  # phase and op names from the SDK or a log (as the SDK caps them)
MAX_MESSAGE = 4096  # a fault's or a command's human message
MAX_EVIDENCE = 256 * 1024  # a fault's evidence JSON
MAX_EVIDENCE_DEPTH = 64  # nesting of a fault's evidence JSON (deeper: replaced by an error)
MAX_STACKS = 512 * 1024  # one Stacks message's JSON (an agent clips what it sends to it)
MAX_STACK_TEXT = 32 * 1024  # one process's py-spy text in a Stacks message: the first
# frames of its first 8 threads, which is what the arbiter compares (16 processes fit)
MAX_WHERE = 200  # a place in the trainer's code ("save (serialization.py:966) from ...")
MAX_ID = 128  # fault and command ids, agent instance ids
MAX_SPARES = 8  # per job: warm spares (`ftagent run --spare`) the arbiter keeps
MAX_OPEN_FAULTS = 10_000  # per job: faults awaiting a decision (stacks, a link down)
MAX_GPUS = 64  # GPU ids in one Hello (a node has <= 16 GPUs; MIG slices up to 7 each)
MAX_GPU_ID = 64  # one GPU id: GPU-<uuid> is 40 characters, MIG-<uuid> 41
MAX_NODE_FAULTS = 64  # faults in one NodeReport (a node agent sends the rest next)
MAX_DIGITS = 20  # a number in a log line longer than this is not a step
MAX_SDK_DATAGRAM = 512  # one SDK datagram (the SDK's own are < 200 bytes)
MAX_SECONDS = 7 * 24 * 3600.0  # a duration from the SDK (a collective's time)
MAX_TOTAL_SECONDS = 1e9  # a duration summed over a trainer's life (~31 years)
MAX_PID = 2**22  # Linux's PID_MAX_LIMIT
MAX_TIMED_STEPS = 1_000_000  # steps one ProgressSummary's means per step are over

MAX_PHASES = 32
"""Distinct phase names one agent keeps, as label values and as hang budgets learned.
Trainers declare a handful (checkpoint, eval, save); a name made per step
(``ftagent.phase(f"ckpt-{step}")``) would add a histogram (15 series) and a learned budget
per step: 25,000 of them made 900k series, a 118 MB scrape and an 854 MB agent. The first
32 distinct names are kept; later ones are folded into ``OTHER`` (and counted)."""

MAX_OPS = 32
"""Distinct collective op names one agent exports: torch.distributed has about 15
collectives (with its ``_coalesced``/``_into_tensor`` variants), so 32 leaves room for
custom ones; later names are folded into ``OTHER`` (and counted)."""

OTHER = "other"  # the label value names past a cap are folded into


class LabelFold:
    """Bounds one label's values: the first ``cap`` distinct values pass, later ones (and
    values outside ``allowed``, when given) become ``OTHER``; ``on_fold`` is called for
    each value folded. Memory is O(cap) whatever comes in. Thread-safe enough for one
    event loop plus the scrape thread (the set only grows, under the GIL)."""

    __slots__ = ("label", "cap", "allowed", "on_fold", "seen", "folded")

    def __init__(self, label: str, cap: int, *, allowed: Iterable[str] | None = None,
                 on_fold: Callable[[], None] | None = None) -> None:
        self.label = label
        self.cap = cap
        self.allowed = None if allowed is None else frozenset(allowed)
        self.on_fold = on_fold
        self.seen: set[str] = set()
        self.folded = 0

    def __call__(self, value: str) -> str:
        if value in self.seen or value == OTHER:
            return value
        if (self.allowed is None or value in self.allowed) and len(self.seen) < self.cap:
            self.seen.add(value)
            return value
        self.folded += 1
        if self.on_fold is not None:
            self.on_fold()
        return OTHER


class OutOfRange(ValueError):
    """A value from a peer outside its field's range; the message names the field."""


def check_int(name: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise OutOfRange(f"{name} {value} is out of range [{lo}, {hi}]")
    return value


def check_name(name: str, value: str, limit: int = MAX_NAME, *, required: bool = False) -> str:
    """A short string of printable characters (no control characters, no newlines)."""
    if required and not value:
        raise OutOfRange(f"{name} is empty")
    if len(value) > limit:
        raise OutOfRange(f"{name} is {len(value)} characters long; at most {limit}")
    if not value.isprintable():
        raise OutOfRange(f"{name} {value[:40]!r} contains control characters")
    return value


def check_generation(name: str, value: int) -> int:
    return check_int(name, value, -1, MAX_GENERATION)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, marked when cut (for messages, not names)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def printable(text: str) -> str:
    """``text`` with every character that is not printable (C0/C1 controls such as ESC,
    newlines, bidi overrides, other format characters) written as a Python escape: a
    peer's message shown by ``ftagent status``, a report, the timeline or a log line can
    move no cursor, colour no terminal and hide nothing. Linear; unchanged when clean."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"
