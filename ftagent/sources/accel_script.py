"""The timeline a simulated ``npu-smi`` / ``xpu-smi`` plays (``--gpu-backend simulated:FILE``
with ``--accelerator ascend|kunlunxin``).

One statement a line; ``#`` starts a comment; times are seconds from the backend's start
(``t=2s``, ``t=500ms``, ``t=1.5``); ``rank=N`` limits a line to one rank::

    devices 2                                 # how many devices the tool shows (default 2)
    device dev=1 name=910B3 bus=0000:c1:00.0 serial=2102312NNA10N5000123 memory=65536
    driver missing                            # the tool is not installed (not on PATH)
    driver not_loaded                         # the tool runs, the driver does not answer
    driver permission                         # the tool runs, this user may not use it
    t=2s dev=1 fault=80CB8002                 # an error code is raised (repeatable)
    t=2s dev=1 health=Critical                # OK | Warning | Alarm | Critical (Ascend)
    t=3s dev=1 clear                          # codes cleared, health back to OK
    t=5s dev=0 lost                           # the device stops answering
    t=5s dev=1 hang                           # its queries hang (until the caller's timeout)
    t=4s dev=0 temp=70 power=300 util=90 mem_used=30000 ecc_uncorrected+=1

``npu=`` and ``xpu=`` are spellings of ``dev=``. The state at a time is the replay of
every line up to it: the simulated tool is a fresh process per call, like the real one.
A malformed line is a ``ScriptError`` naming the file and line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

MAX_DEVICES = 64
MAX_LINES = 100_000
HEALTH = ("OK", "Warning", "Alarm", "Critical", "UNKNOWN")


class ScriptError(ValueError):
    """A malformed timeline; the message names the file and line."""


@dataclass
class DeviceState:
    index: int
    name: str = ""
    bus: str = ""
    serial: str = ""
    memory_total: int = 65536  # MiB
    health: str = "OK"
    codes: list[int] = field(default_factory=list)
    lost: bool = False
    hung: bool = False
    temp: int = 40
    power: float = 90.0
    util: int = 0
    mem_used: int = 3395
    ecc_uncorrected: int = 0
    ecc_corrected: int = 0


@dataclass(frozen=True)
class Step:
    t: float
    line: int
    dev: int
    rank: int | None
    ops: tuple[tuple[str, str, str], ...]  # (key, "=" | "+=" | "", value)


@dataclass
class Timeline:
    devices: int = 2
    specs: dict[int, dict[str, str]] = field(default_factory=dict)
    driver: str = "ok"  # ok | missing | not_loaded | permission
    steps: list[Step] = field(default_factory=list)

    def state(self, now: float, rank: int = 0) -> list[DeviceState]:
        """Every device as the tool shows it ``now`` seconds after the start."""
        out = []
        for i in range(self.devices):
            spec = self.specs.get(i, {})
            out.append(DeviceState(
                i, name=spec.get("name", ""), bus=spec.get("bus", ""),
                serial=spec.get("serial", f"SIM{i:012d}"),
                memory_total=int(spec.get("memory", "65536"))))
        for s in self.steps:
            if s.t > now:
                break
            if s.rank not in (None, rank) or s.dev >= len(out):
                continue
            _apply(out[s.dev], s.ops)
        return out


_NUMERIC = {"temp", "util", "mem_used", "ecc_uncorrected", "ecc_corrected"}


def _apply(d: DeviceState, ops: tuple[tuple[str, str, str], ...]) -> None:
    for key, op, value in ops:
        if key == "lost":
            d.lost = True
        elif key == "hang":
            d.hung = True
        elif key == "clear":
            d.codes, d.health = [], "OK"
        elif key == "fault":
            code = int(value, 16)
            if code not in d.codes:
                d.codes.append(code)
        elif key == "health":
            d.health = value
        elif key == "power":
            d.power = float(value)
        elif key in _NUMERIC:
            n = int(value)
            setattr(d, key, getattr(d, key) + n if op == "+=" else n)


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d{1,7}(?:\.\d{1,6})?)(ms|s)?", text)
    if m is None:
        raise ValueError(f"t={text} is not a time (2s, 500ms, 1.5)")
    return float(m.group(1)) * (0.001 if m.group(2) == "ms" else 1.0)


def _check(key: str, value: str) -> None:
    if key == "fault" and not re.fullmatch(r"(0x)?[0-9A-Fa-f]{1,9}", value):
        raise ValueError(f"fault={value} is not a hexadecimal error code (80CB8002)")
    if key == "health" and value not in HEALTH:
        raise ValueError(f"health={value} is not one of {', '.join(HEALTH)}")
    if key == "power" and not re.fullmatch(r"\d{1,5}(\.\d{1,3})?", value):
        raise ValueError(f"power={value} is not watts")
    if key in _NUMERIC and not re.fullmatch(r"\d{1,12}", value):
        raise ValueError(f"{key}={value} is not a number")


_DEV_KEYS = ("dev", "npu", "xpu")
_FLAGS = ("lost", "clear", "hang")
_KEYS = {*_FLAGS, "fault", "health", "power"} | _NUMERIC


def parse(text: str, name: str = "<timeline>") -> Timeline:
    tl = Timeline()
    for lineno, raw in enumerate(text.splitlines()[:MAX_LINES], 1):
        try:
            _line(tl, raw, lineno)
        except ValueError as e:
            raise ScriptError(f"{name}:{lineno}: {e}") from None
    tl.steps.sort(key=lambda s: (s.t, s.line))
    return tl


def _dev(kv: dict[str, str]) -> int:
    keys = [k for k in _DEV_KEYS if k in kv]
    if len(keys) != 1 or not kv[keys[0]].isdigit() or int(kv[keys[0]]) >= MAX_DEVICES:
        raise ValueError(f"name one device: dev=N (N < {MAX_DEVICES})")
    return int(kv.pop(keys[0]))


def _line(tl: Timeline, raw: str, lineno: int) -> None:
    tokens = shlex.split(raw, comments=True)
    if not tokens:
        return
    head = tokens[0]
    if head == "devices":
        if len(tokens) != 2 or not tokens[1].isdigit() or int(tokens[1]) > MAX_DEVICES:
            raise ValueError(f"devices takes a number up to {MAX_DEVICES}")
        tl.devices = int(tokens[1])
        return
    if head == "driver":
        if len(tokens) != 2 or tokens[1] not in ("ok", "missing", "not_loaded", "permission"):
            raise ValueError("driver takes ok, missing, not_loaded or permission")
        tl.driver = tokens[1]
        return
    if head == "device":
        spec = dict(t.split("=", 1) for t in tokens[1:] if "=" in t)
        if len(spec) != len(tokens) - 1:
            raise ValueError("device takes dev=N and key=value pairs")
        dev = _dev(spec)
        unknown = set(spec) - {"name", "bus", "serial", "memory"}
        if unknown:
            raise ValueError(f"device: unknown {', '.join(sorted(unknown))}")
        if "memory" in spec and not (spec["memory"].isdigit() and len(spec["memory"]) < 9):
            raise ValueError("memory= is MiB")
        tl.specs[dev] = spec
        tl.devices = max(tl.devices, dev + 1)
        return
    if not head.startswith("t="):
        raise ValueError(f"{head!r} is not devices, device, driver or t=TIME")
    t = _seconds(head[2:])
    kv: dict[str, str] = {}
    rank = None
    ops: list[tuple[str, str, str]] = []
    for tok in tokens[1:]:
        key, sep, value = tok.partition("=")
        plus = key.endswith("+")
        key = key.rstrip("+")
        if key in _DEV_KEYS:
            kv[key] = value
            continue
        if key == "rank":
            if not value.isdigit():
                raise ValueError("rank= is a number")
            rank = int(value)
            continue
        if key not in _KEYS:
            raise ValueError(f"unknown {key!r} (known: {', '.join(sorted(_KEYS))})")
        if key in _FLAGS and sep:
            raise ValueError(f"{key} takes no value")
        if key not in _FLAGS:
            if not sep:
                raise ValueError(f"{key} needs a value")
            _check(key, value)
        ops.append((key, "+=" if plus else ("=" if sep else ""), value))
    if not ops:
        raise ValueError("a t= line needs something to happen")
    tl.steps.append(Step(t, lineno, _dev(kv), rank, tuple(ops)))


def load(path: str) -> Timeline:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(8 << 20)
    except OSError as e:
        raise ScriptError(f"{path}: {e.strerror or e}") from None
    return parse(text, path)
