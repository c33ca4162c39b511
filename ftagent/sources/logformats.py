"""What the popular trainers print, and how each line becomes a Progress, a PhaseMarker or a
Resumed (the step a restarted trainer loaded its checkpoint at).

Each ``LogFormat`` below is one framework (or family): the substrings (*needles*) that any
of its interesting lines contains, and a parse function that takes one decoded line with
ANSI colours already stripped. ``sources/progress.py`` uses the needles as a cheap
pre-filter over raw bytes and calls the parse functions only on the few lines that pass.

Formats parse ``key: value`` pairs (split on ``|``, `` - `` or ``,``), never fixed columns,
because every framework reorders and adds columns between releases. Some need memory of
earlier lines (``ParseState``): Keras and Paddle count steps per epoch, so the global step
is ``epoch × steps per epoch + n``; HF Trainer prints its loss in a dict and its step only
in the tqdm bar; Megatron's eval interval is only in the argument dump at start-up.

Only a completed step yields ``Progress``: "waiting for data" lines, loss-less step
mentions and bars at 0 do not. A redraw of the same step (tqdm) yields the same step
number again; the hang detector ignores steps that do not increase, so no dedup here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from ftagent.model import PhaseMarker, PhaseTiming, Progress, Resumed
from ftagent.wire.limits import MAX_DIGITS, MAX_STEP


class Claimed:
    """A line a format recognised that yields nothing (an epoch header, a bar at 0, an
    evaluation step): no later, more generic format may read it as a training step."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CLAIMED"


CLAIMED: Final = Claimed()
Parsed = Progress | PhaseMarker | PhaseTiming | Resumed | Claimed | None

ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")


MAX_NUMBER = 64  # characters of a float in a log line; a longer run is not a value


class OutOfBounds(ValueError):
    """A count in a log line (step, total, samples, epoch) with more than ``MAX_DIGITS``
    digits or above ``MAX_STEP``: the line is not a step (the parser returns nothing)."""


def count(text: str) -> int:
    """A count from a log line's digits, bounded (``OutOfBounds``): never ``int()`` of a
    4,400-digit run (Python refuses those), never a step no float or peer can carry."""
    if len(text) > MAX_DIGITS:
        raise OutOfBounds(f"{len(text)} digits")
    value = int(text)
    if value > MAX_STEP:
        raise OutOfBounds(f"{value} > {MAX_STEP}")
    return value


def count_of(value: float | None) -> int | None:
    """A count that was parsed as a float (``global_step: 1.2E+03``), bounded likewise;
    None for NaN."""
    if value is None or value != value:
        return None
    if not 0 <= value <= MAX_STEP:
        raise OutOfBounds(f"{value} is out of [0, {MAX_STEP}]")
    return int(value)


def number(text: str | None) -> float | None:
    """A float from a log value: ``1.04E+01``, ``1,444``, ``[0.55]``, ``'1.16'``, ``nan``.
    Finite or NaN (a NaN loss is news); infinities and over-long runs are None."""
    if text is None or len(text) > 4 * MAX_NUMBER:
        return None
    t = text.strip().strip("[]'\"").replace(",", "")
    if not t or len(t) > MAX_NUMBER:
        return None
    try:
        value = float(t)
    except ValueError:
        return None
    return None if value in (math.inf, -math.inf) else value


def _rate(value: float | None) -> float | None:
    """A throughput only when it is a positive finite number (never NaN/inf on a gauge)."""
    return value if value is not None and 0 < value < float("inf") else None


@dataclass
class EpochCounter:
    """A global step from per-epoch counters, for formats that restart their count."""

    epoch: int | None = None
    base: int = 0
    last_n: int = 0

    def global_step(self, epoch: int, n: int, total: int | None, first_epoch: int) -> int:
        if total:  # exact and stateless: survives missed lines and resumed runs
            return (epoch - first_epoch) * total + n
        if self.epoch is None or epoch < self.epoch:
            self.epoch, self.base = epoch, 0
        elif epoch > self.epoch:
            self.base += self.last_n + 1
            self.epoch = epoch
        self.last_n = n
        return self.base + n


@dataclass
class ParseState:
    """What earlier lines of this trainer said that later lines need."""

    epoch: int | None = None  # Keras / Paddle hapi "Epoch 3/10" (1-based)
    hapi_eval: bool = False  # between "Eval begin..." and "Eval samples: N"
    bar_total: int | None = None  # total of the main (training) tqdm bar
    bar_done: bool = False  # the main bar reached its total; a new one may start
    bar_step: int | None = None  # last step of the main bar; HF loss dicts use it
    bar_eval: bool = False  # an eval bar is running (a PhaseMarker was emitted)
    lightning: EpochCounter = field(default_factory=EpochCounter)
    fleet: EpochCounter = field(default_factory=EpochCounter)
    mxnet: EpochCounter = field(default_factory=EpochCounter)
    eval_interval: int = 0  # Megatron --eval-interval, from the argument dump
    eval_iters: int = 0  # Megatron --eval-iters
    consumed: tuple[int, int] | None = None  # Megatron (iteration, consumed samples)
    iteration: int | None = None  # Megatron's last logged iteration
    log_interval: int = 1  # iterations between its last two logged ones (timers average)


@dataclass(frozen=True)
class LogFormat:
    """One framework's lines. ``needles``: every line ``parse`` can use contains one of them.
    ``startup``: needles of lines printed only before training (looked for until the format
    is known). ``family``: formats that appear together (HF's bar and its loss dicts)."""

    name: str
    family: str
    needles: tuple[str, ...]
    parse: Callable[[str, float, ParseState], Parsed]
    startup: tuple[str, ...] = ()


def pairs(segments: list[str]) -> dict[str, str]:
    """``key: value`` segments to a dict with lower-case keys (last colon splits)."""
    out: dict[str, str] = {}
    for seg in segments:
        key, sep, value = seg.rpartition(":")
        if sep:
            out[key.strip().lower()] = value.strip()
    return out


def pick_loss(kv: dict[str, str], preferred: tuple[str, ...]) -> float | None:
    for k in preferred:
        if k in kv:
            return number(kv[k])
    for k, v in kv.items():
        if k.endswith("loss") and not k.startswith(("val", "eval", "test")):
            return number(v)
    return None


# ---------------------------------------------------------------- resumed from a checkpoint

# What a trainer prints once it has loaded a checkpoint, and where the step is; each
# prefix is found with ``str.find`` and the number read with an anchored match (linear in
# the line, whatever it repeats). (prefix, where the step is, source):
#   "after": the digits right after the prefix;
#   "iteration": after the last " at iteration " following the prefix;
#   "global_step" / "step=": after the last such word in the path following the prefix.
RESUME_LINES: tuple[tuple[str, str, str], ...] = (
    # Megatron-LM (training/checkpointing.py): "  successfully loaded checkpoint from
    # DIR [ t 0/1, p 0/1 ] at iteration 1200" (older releases: no [ t, p ] part)
    ("successfully loaded checkpoint from ", "iteration", "megatron"),
    # DeepSpeed (TorchCheckpointEngine.load): "[Torch] Loaded checkpoint from
    # DIR/global_step1200/mp_rank_00_model_states.pt." (the default tag: global_stepN)
    ("Loaded checkpoint from ", "global_step", "deepspeed"),
    # HF Trainer: "  Continuing training from global step 1200"
    ("Continuing training from global step ", "after", "hf"),
    # torchtitan (CheckpointManager): "Loading the checkpoint at step 1200."
    ("Loading the checkpoint at step ", "after", "torchtitan"),
    # Lightning: "Restored all states from the checkpoint (file )?at
    # DIR/epoch=3-step=1200.ckpt" (the step only where the file name has it: the
    # default ModelCheckpoint name does)
    ("Restored all states from the checkpoint", "step=", "lightning"),
    # hand-written loops (examples/train.py): "resumed from checkpoint at step 1200"
    ("esumed from checkpoint at step ", "after", "generic"),
)
# every line above but HF's has "heckpoint", a needle already (no extra scan of output)
RESUME_NEEDLES = ("heckpoint", "training from global step ")
_DIGITS = re.compile(r"[0-9]+")


def parse_resume(text: str, ts: float, st: ParseState) -> Parsed:
    """A "loaded checkpoint ... iteration N" line of a known trainer → ``Resumed(N)``: N is
    the last step kept (the trainer's next step is N + 1). A line of that shape without a
    step (a Lightning file name without ``step=``) yields nothing: unknown, not a guess."""
    for prefix, where, source in RESUME_LINES:
        i = text.find(prefix)
        if i < 0:
            continue
        at = i + len(prefix)
        if where == "iteration":
            j = text.rfind(" at iteration ", at)
            at = j + len(" at iteration ") if j >= 0 else -1
        elif where != "after":
            j = text.rfind(where, at)
            at = j + len(where) if j >= 0 else -1
        m = _DIGITS.match(text, at) if at >= 0 else None
        if m is None:
            return CLAIMED
        return Resumed(step=count(m.group()), source=source, ts=ts)
    return None


# --------------------------------------------------------------------------- Megatron / NeMo 2

MEGATRON_IT = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
MEGATRON_SAVE = re.compile(r"\bsaving checkpoint at iteration\s+(\d+)")
MEGATRON_SAVED = re.compile(r"\bsuccessfully saved checkpoint (?:from|at) iteration\s+(\d+)")
MEGATRON_VALID = re.compile(r"\bvalidation loss at iteration\s+\d+")
MEGATRON_ARG = re.compile(r"^\s*(eval_interval|eval_iters)\s\.{3,}\s*(\d+)\s*$")
MEGATRON_LOSS = ("lm loss", "reduced_train_loss", "loss", "train_loss")
MEGATRON_TFLOPS = "throughput per gpu (tflop/s/gpu)"
# A timer line after "(min, max) time across ranks (ms):" or "max time across ranks (ms):":
# "    forward-backward ......: (26094.39, 26095.09)" or "    optimizer .....: 3409.92".
_MS = r"([0-9]{1,12}(?:\.[0-9]{0,6})?)"
MEGATRON_TIMER = re.compile(r"^([a-z][a-z0-9/-]{0,60}) \.{2,80}: \(?" + _MS
                            + r"(?:, " + _MS + r"\))?$")
# The timers that are parts of a training step -> the phase label (forward, backward,
# optimizer and data as ftagent.torch names them; the rest keep Megatron's names). A
# fixed set: other timers (setup, checkpoint saves: a declared phase already) are not
# exported, so the label stays bounded whatever a log says.
MEGATRON_TIMERS = {
    "forward-backward": "forward-backward", "forward-compute": "forward",
    "backward-compute": "backward", "batch-generator": "data", "optimizer": "optimizer",
    **{t: t for t in (
        "all-grads-sync", "params-all-gather", "layernorm-grads-all-reduce",
        "embedding-grads-all-reduce", "optimizer-copy-to-main-grad",
        "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
        "optimizer-count-zeros", "optimizer-inner-step",
        "optimizer-copy-main-to-model-params", "forward-recv", "forward-send",
        "backward-recv", "backward-send", "forward-send-backward-recv",
        "backward-send-forward-recv")},
}


def parse_megatron(text: str, ts: float, st: ParseState) -> Parsed:
    """Megatron-LM (and NeMo 2, which prints the same ``iteration N/M | k: v |`` shape)."""
    m = MEGATRON_IT.search(text)
    if m is None:
        return _megatron_other(text, ts, st)
    kv = pairs(text[m.end():].split("|"))
    step = count(m.group(1))
    nemo = "global_step" in kv
    if nemo:
        step = count_of(number(kv["global_step"])) or step
    step_seconds = None
    if "elapsed time per iteration (ms)" in kv:
        ms = number(kv["elapsed time per iteration (ms)"])
        step_seconds = ms / 1000.0 if ms is not None else None
    elif "train_step_timing in s" in kv:
        step_seconds = number(kv["train_step_timing in s"])
    batch = number(kv.get("global batch size", kv.get("global_batch_size")))
    consumed = number(kv.get("consumed samples", kv.get("consumed_samples")))
    if batch is None and consumed is not None and st.consumed is not None:
        prev_step, prev_consumed = st.consumed
        if step > prev_step:
            batch = (consumed - prev_consumed) / (step - prev_step)
    if consumed is not None:
        st.consumed = (step, count_of(consumed) or 0)
    if st.iteration is not None and 0 < step - st.iteration <= 1_000_000:
        st.log_interval = step - st.iteration
    st.iteration = step
    sps = batch / step_seconds if batch and step_seconds else None
    if (not nemo and st.eval_interval and st.eval_iters and step % st.eval_interval == 0):
        # Megatron evaluates right after logging this iteration and prints nothing until
        # "validation loss at iteration N": the phase starts now (this step's Progress
        # is not emitted; one line yields one observation, and the phase matters more).
        return PhaseMarker("eval", True, source="megatron", ts=ts)
    # Megatron's M in "iteration N/M" is --train-iters; NeMo's is per epoch, not the end.
    total = None if nemo else count(m.group(2))
    return Progress(step=step, loss=pick_loss(kv, MEGATRON_LOSS), samples_per_second=_rate(sps),
                    step_seconds=step_seconds, total_steps=total,
                    source="nemo" if nemo else "megatron", ts=ts,
                    tflops_per_gpu=_rate(number(kv.get(MEGATRON_TFLOPS))))


def parse_megatron_timer(text: str, ts: float, st: ParseState) -> Parsed:
    """One of Megatron's timer lines (``timers.log``): milliseconds per iteration averaged
    over the log interval, the slowest rank's (max) when it prints (min, max). It becomes
    the interval's total: ``log_interval`` occurrences of that many seconds."""
    m = MEGATRON_TIMER.match(text)
    if m is None:
        return None
    phase = MEGATRON_TIMERS.get(m.group(1))
    if phase is None:
        return CLAIMED
    ms = number(m.group(3) or m.group(2))
    if ms is None or not 0.0 <= ms < 1e9:
        return CLAIMED
    n = st.log_interval
    return PhaseTiming(phase=phase, seconds=ms / 1000.0 * n, count=n, source="megatron",
                       ts=ts)


def _megatron_other(text: str, ts: float, st: ParseState) -> Parsed:
    if "checkpoint" in text:
        if MEGATRON_SAVED.search(text):
            return PhaseMarker("checkpoint", False, source="megatron", ts=ts)
        if MEGATRON_SAVE.search(text):
            return PhaseMarker("checkpoint", True, source="megatron", ts=ts)
        return None
    if MEGATRON_VALID.search(text):
        return PhaseMarker("eval", False, source="megatron", ts=ts)
    m = MEGATRON_ARG.match(text)
    if m:
        if m.group(1) == "eval_interval":
            st.eval_interval = count(m.group(2))
        else:
            st.eval_iters = count(m.group(2))
        return CLAIMED
    return None


# --------------------------------------------------------------------------- DeepSpeed

DS_STEP = re.compile(r"\bstep=(\d+),\s*skipped=\d+")
DS_TIMER = re.compile(r"\bglobal_step=(\d+),\s*RunningAvgSamplesPerSec=([^,\s]+)"
                      r"(?:,\s*CurrSamplesPerSec=([^,\s]+))?")
DS_CKPT = re.compile(r"\bCheckpoint \S+ is (about to be saved|ready now)!")


def parse_deepspeed(text: str, ts: float, st: ParseState) -> Parsed:
    # Substring checks first: a regex search costs microseconds, ``in`` tens of ns.
    m = DS_TIMER.search(text) if "global_step=" in text else None
    if m:
        sps = number(m.group(3)) if m.group(3) else number(m.group(2))
        return Progress(step=count(m.group(1)), samples_per_second=_rate(sps),
                        source="deepspeed", ts=ts)
    m = DS_STEP.search(text) if "skipped=" in text else None
    if m:
        return Progress(step=count(m.group(1)), source="deepspeed", ts=ts)
    m = DS_CKPT.search(text) if "Checkpoint " in text else None
    if m:
        return PhaseMarker("checkpoint", m.group(1) != "ready now", source="deepspeed", ts=ts)
    return None


# --------------------------------------------------------------------------- torchtitan

TITAN_STEP = re.compile(r"\bstep:\s*(\d+)(?:/\d+\s*=\s*[\d.]+%)?\s+loss:\s*(\S+)")
TITAN_TPS = re.compile(r"\btps:\s*([\d,.]+)")
TITAN_TIME = re.compile(r"\bstep_time:\s*([\d.]+)")
TITAN_SAVE = re.compile(r"\bSaving (?:the |a .*?)checkpoint\b")
TITAN_SAVED = re.compile(r"\b(?:Finished saving the checkpoint|Last step checkpoint completed)")


def parse_torchtitan(text: str, ts: float, st: ParseState) -> Parsed:
    m = TITAN_STEP.search(text) if "step:" in text else None
    if m:
        tps = TITAN_TPS.search(text)
        st_m = TITAN_TIME.search(text)
        return Progress(step=count(m.group(1)), loss=number(m.group(2)),
                        tokens_per_second=_rate(number(tps.group(1))) if tps else None,
                        step_seconds=number(st_m.group(1)) if st_m else None,
                        source="torchtitan", ts=ts)
    if "checkpoint" in text:
        if TITAN_SAVED.search(text):
            return PhaseMarker("checkpoint", False, source="torchtitan", ts=ts)
        if TITAN_SAVE.search(text):
            return PhaseMarker("checkpoint", True, source="torchtitan", ts=ts)
    return None


# --------------------------------------------------------------------------- tqdm (HF, Lightning)

# The description is what precedes the match (no lazy ``^(.*?)``: quadratic in a long
# line of digits). Every run is bounded or stops at the next delimiter, so a hostile line
# costs time linear in its length (tests/unit/test_logformats.py times the worst shapes).
TQDM = re.compile(r"(?<!\d)(?P<pct>\d{1,3})%\|[^|]{0,1000}\|\s{0,40}(?P<n>\d++)/(?P<total>\d++)"
                  r"\s{0,40}\[[^<\]]{0,40}<[^,\]]{0,40}(?:,\s{0,40}(?P<rest>[^\]]{0,2000}))?\]")
LIGHTNING_EPOCH = re.compile(r"^Epoch (\d+)\b")
EVAL_DESC = ("valid", "eval", "test", "predict")
TQDM_LOSS = ("loss", "train_loss", "train_loss_step", "loss_step")


def parse_tqdm(text: str, ts: float, st: ParseState) -> Parsed:
    """A tqdm bar redraw. ``Epoch N:`` bars are Lightning's; bars without a description are
    HF Trainer's (or a custom loop's): the first is the training bar, and another bar
    with a different total while it runs is an evaluation (HF prints no other sign)."""
    m = TQDM.search(text)
    if m is None:
        return None
    desc = text[:m.start()].strip().rstrip(":").strip()
    n, total = count(m.group("n")), count(m.group("total"))
    rest = [p.strip() for p in (m.group("rest") or "").split(",")]
    low = desc.lower()
    if low.startswith("sanity"):  # before the first step: the first-step budget covers it
        return CLAIMED
    if any(w in low for w in EVAL_DESC):
        return _bar_eval(st, ts)
    em = LIGHTNING_EPOCH.match(desc)
    if em:
        if st.bar_eval:
            st.bar_eval = False
            return PhaseMarker("eval", False, source="lightning", ts=ts)
        if n == 0:
            return CLAIMED
        step = st.lightning.global_step(count(em.group(1)), n, total, first_epoch=0)
        return _bar_progress(step, rest, ts, "lightning")
    if desc and "train" not in low and "step" not in low and "iter" not in low:
        return CLAIMED  # "Map", "Loading checkpoint shards", "Downloading": not training
    if st.bar_total is None or (st.bar_done and total != st.bar_total):
        st.bar_total, st.bar_done = total, False
    if total != st.bar_total:
        return _bar_eval(st, ts)
    if st.bar_eval:
        st.bar_eval = False
        return PhaseMarker("eval", False, source="tqdm", ts=ts)
    st.bar_done = n >= total
    if n == 0:
        return CLAIMED
    st.bar_step = n
    return dataclasses.replace(_bar_progress(n, rest, ts, "tqdm"), total_steps=total)


def _bar_eval(st: ParseState, ts: float) -> Parsed:
    if st.bar_eval:
        return CLAIMED
    st.bar_eval = True
    return PhaseMarker("eval", True, source="tqdm", ts=ts)


def _bar_progress(step: int, rest: list[str], ts: float, source: str) -> Progress:
    rate = rest[0] if rest else ""
    step_seconds = None
    if rate.endswith("it/s"):
        r = number(rate[:-4])
        step_seconds = 1.0 / r if r else None
    elif rate.endswith("s/it"):
        step_seconds = number(rate[:-4])
    kv = {k.strip().lower(): v for k, _, v in (p.partition("=") for p in rest[1:])}
    loss = next((number(kv[k]) for k in TQDM_LOSS if k in kv), None)
    return Progress(step=step, loss=loss, step_seconds=step_seconds, source=source, ts=ts)


HF_LOSS = re.compile(r"[{,]\s*['\"]loss['\"]\s*:\s*['\"]?([^,'\"}\s]+)")


def parse_hf_dict(text: str, ts: float, st: ParseState) -> Parsed:
    """``{'loss': 1.16, 'grad_norm': ..., 'epoch': 6.21}``: the step is the bar's last one."""
    if not text.lstrip().startswith("{") or st.bar_step is None:
        return None
    m = HF_LOSS.search(text)
    if m is None:
        return None
    return Progress(step=st.bar_step, loss=number(m.group(1)), source="hf", ts=ts)


# --------------------------------------------------------------------------- Keras, Paddle hapi

EPOCH_LINE = re.compile(r"^\s*Epoch (\d+)/(\d+)\s*$")
KERAS_BAR = re.compile(r"^\s*(\d+)/(\d+)\s+(?:\[[=>.]*\]|[━─]+)(.*)$")
HAPI_STEP = re.compile(r"^\s*step\s+(\d+)(?:/(\d+))?\s+(?:\[[=>.]*\]\s*)?-\s(.*)$")
PER_STEP = re.compile(r"(?<![\d.])(\d{1,20}(?:\.\d{1,20})?)(us|ms|s)/step")
UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_epoch_bar(text: str, ts: float, st: ParseState) -> Parsed:
    """Keras (``120/500 [===>...] - loss: 0.31``) and Paddle hapi (``step 10/938 - loss: ..``),
    both after an ``Epoch 3/10`` line; hapi brackets its evaluation with ``Eval begin...`` and
    ``Eval samples: N``."""
    m = EPOCH_LINE.match(text)
    if m:
        st.epoch = count(m.group(1))
        st.hapi_eval = False
        return CLAIMED
    if text.startswith("Eval begin"):
        st.hapi_eval = True
        return PhaseMarker("eval", True, source="paddle", ts=ts)
    if text.startswith("Eval samples"):
        if not st.hapi_eval:
            return CLAIMED
        st.hapi_eval = False
        return PhaseMarker("eval", False, source="paddle", ts=ts)
    m = KERAS_BAR.match(text)
    source = "keras"
    if m is None:
        m = HAPI_STEP.match(text)
        source = "paddle"
        if m is None:
            return None
        if st.hapi_eval:
            return CLAIMED
    n = count(m.group(1))
    total = count(m.group(2)) if m.group(2) else None
    kv = pairs(m.group(3).split(" - "))
    if "loss" not in kv and not PER_STEP.search(m.group(3)):
        return None
    per = PER_STEP.search(m.group(3))
    per_step = number(per.group(1)) if per else None
    step_seconds = per_step * UNIT[per.group(2)] if per and per_step is not None else None
    epoch = st.epoch or 1
    step = (epoch - 1) * total + n if total else n
    return Progress(step=step, loss=number(kv.get("loss")), step_seconds=step_seconds,
                    source=source, ts=ts)


# --------------------------------------------------------------------------- Paddle fleet, MXNet

FLEET = re.compile(r"\bepoch:\s*(\d+),\s*batch(?:_id)?:\s*(\d+),(.*)$")
MXNET = re.compile(r"\bEpoch\[(\d+)\]\s+Batch\s*\[(?:\d+-)?(\d+)\]\s+Speed:\s*([\d.]+)\s*"
                   r"samples/sec(.*)$")


def parse_fleet(text: str, ts: float, st: ParseState) -> Parsed:
    """``epoch: 0, batch_id: 10, loss: 2.3, speed: 12.3 steps/s`` (Paddle fleet examples)."""
    m = FLEET.search(text) if "epoch:" in text else None
    if m is None:
        return None
    kv = pairs(m.group(3).split(","))
    loss = pick_loss(kv, ("loss",))
    if loss is None:
        return None
    step = st.fleet.global_step(count(m.group(1)), count(m.group(2)), None, first_epoch=0)
    speed = kv.get("speed", "")
    step_seconds = None
    if speed.endswith(("steps/s", "step/s")):
        r = number(speed.split()[0])
        step_seconds = 1.0 / r if r else None
    return Progress(step=step, loss=loss, step_seconds=step_seconds, source="paddle", ts=ts)


def parse_mxnet(text: str, ts: float, st: ParseState) -> Parsed:
    """``Epoch[0] Batch [100-200]\\tSpeed: 1234.5 samples/sec\\taccuracy=0.91`` (Speedometer)."""
    m = MXNET.search(text) if "Epoch[" in text else None
    if m is None:
        return None
    metrics = dict(p.partition("=")[::2] for p in m.group(4).split() if "=" in p)
    loss = next((number(v) for k, v in metrics.items() if "loss" in k or "entropy" in k), None)
    step = st.mxnet.global_step(count(m.group(1)), count(m.group(2)), None, first_epoch=0)
    return Progress(step=step, loss=loss, samples_per_second=_rate(number(m.group(3))),
                    source="mxnet", ts=ts)


# --------------------------------------------------------------------------- generic

# Possessive runs (``*+``, ``++``): ``\s*[:=]?\s*`` backtracks quadratically over a long
# run of blanks; ``\s*+(?:[:=]\s*+)?`` matches the same text and never backtracks.
GENERIC_STEP = re.compile(r"(?<![\w/])step\b\s*+(?:[:=#]\s*+)?(\d++)(?:\s*+/\s*+(\d++))?(?![\d.])",
                          re.I)
GENERIC_LOSS = re.compile(r"(?<![\w])(?:train(?:ing)?[_ ])?loss\b\s*+(?:[:=]\s*+)?"
                          r"([-+]?(?:\d++\.?\d*+(?:[eE][-+]?\d++)?|nan|inf))", re.I)
GENERIC_SPS = re.compile(r"\b(?:samples_per_second|samples/s(?:ec)?)\s*+(?:[:=]\s*+)?([\d.]++)",
                         re.I)
GENERIC_TPS = re.compile(r"\b(?:tokens_per_second|tokens/s(?:ec)?|tok/s)\s*+(?:[:=]\s*+)?"
                         r"([\d,.]++)", re.I)


def parse_generic(text: str, ts: float, st: ParseState) -> Parsed:
    """``step=12 loss=0.42 samples_per_second=1234.5``, ``Step 12/1000 | loss: 0.42``: a step
    number and a loss on one line. A step without a loss ("step 5: waiting for data") is not
    a completed step."""
    s = GENERIC_STEP.search(text)
    if s is None:
        return None
    lm = GENERIC_LOSS.search(text)
    if lm is None:
        return None
    low = text.lower()
    sps = GENERIC_SPS.search(text) if "sample" in low else None
    tps = GENERIC_TPS.search(text) if "tok" in low else None
    return Progress(step=count(s.group(1)), loss=number(lm.group(1)),
                    samples_per_second=_rate(number(sps.group(1))) if sps else None,
                    tokens_per_second=_rate(number(tps.group(1))) if tps else None,
                    total_steps=count(s.group(2)) if s.group(2) else None,
                    source="generic", ts=ts)


# Order matters: specific shapes before the generic "step ... loss" one. The needles
# of a format must cover every line its parse function can turn into an observation.
FORMATS: tuple[LogFormat, ...] = (  # "tep" is in "step" and "Step"
    LogFormat("resume", "resume", RESUME_NEEDLES, parse_resume),
    LogFormat("megatron", "megatron", ("iter", "heckpoint"), parse_megatron, ("interval",)),
    LogFormat("megatron_timer", "megatron", ("..: ",), parse_megatron_timer),
    LogFormat("deepspeed", "deepspeed", ("tep", "heckpoint"), parse_deepspeed),
    LogFormat("torchtitan", "torchtitan", ("tep", "heckpoint"), parse_torchtitan),
    LogFormat("tqdm", "tqdm", ("%|",), parse_tqdm),
    LogFormat("hf", "tqdm", ("loss",), parse_hf_dict),
    LogFormat("epoch_bar", "epoch_bar", ("Epoch", "tep", "loss", "Eval"), parse_epoch_bar),
    LogFormat("fleet", "fleet", ("loss",), parse_fleet),
    LogFormat("mxnet", "mxnet", ("Epoch",), parse_mxnet),
    LogFormat("generic", "generic", ("tep",), parse_generic),
)

# Phase markers are looked for whatever the format: a checkpoint line in the shape of
# Megatron's is common in hand-written loops too (examples/train.py prints one).
ALWAYS_NEEDLES: tuple[str, ...] = ("heckpoint",)
