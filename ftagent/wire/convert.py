"""Between ftagent.model values and the ftagent.v1 wire messages, for both sides.

The agent and the arbiter both stand on this module (neither imports the other).
Enums map by name (model ``FaultKind.CRASH`` <-> proto ``FAULT_KIND_CRASH``), so adding
a kind to both is the whole change. Decoding is lenient where the sender may be newer
(unknown enum values become the closest safe value) and strict nowhere else; the range
checks of every field a peer sends are in ``wire.limits``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from itertools import accumulate
from typing import Any

from ftagent.model import Action, ActionKind, Fault, FaultKind, JobBusy, Progress, Scope, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits

log = logging.getLogger("ftagent.wire.convert")


def fault_to_proto(f: Fault, generation: int, exit_status: int | None = None) -> pb.Fault:
    """The wire fault, within the limits the arbiter checks (so it is never refused): the
    message clipped, the evidence shrunk by its largest parts, numbers clamped."""
    msg = pb.Fault(
        id=f.id[:limits.MAX_ID],
        kind="FAULT_KIND_" + f.kind.name,
        severity="SEVERITY_" + f.severity.name,
        scope="SCOPE_" + f.scope.name,
        # the bound compared in line (a message within it calls nothing); ``clip`` cuts
        # and marks one past it, as everywhere
        message=f.message if len(f.message) <= limits.MAX_MESSAGE
        else limits.clip(f.message, limits.MAX_MESSAGE),
        evidence_json=evidence_json(f.evidence),
        detected_at=f.detected_at if math.isfinite(f.detected_at) else 0.0,
        generation=min(max(generation, 0), limits.MAX_GENERATION),
    )
    if exit_status is not None and -2**31 <= exit_status < 2**31:
        msg.exit_status = exit_status
    return msg


def evidence_json(evidence: dict[str, Any], limit: int = limits.MAX_EVIDENCE) -> str:
    """``evidence`` as JSON of at most ``limit`` bytes: the largest values (py-spy stacks
    of a big tree, long lines) are replaced by a note of their size until it fits."""
    try:
        text = json.dumps(evidence, default=str)
    except (TypeError, ValueError):
        return json.dumps({"unserializable": repr(evidence)[:2000]})
    if len(text.encode()) <= limit:
        return text
    parts = {k: json.dumps(v, default=str) for k, v in evidence.items()}
    kept: dict[str, Any] = dict(evidence)
    for key in sorted(parts, key=lambda k: len(parts[k]), reverse=True):
        kept[key] = {"truncated": True, "json_bytes": len(parts[key].encode())}
        text = json.dumps(kept, default=str)
        if len(text.encode()) <= limit:
            return text
    return json.dumps({"truncated": True, "keys": sorted(evidence)[:50]})[:limit]


def stacks_json(captured: Any, limit: int = limits.MAX_STACKS,
                per_text: int = limits.MAX_STACK_TEXT) -> str:
    """A DUMP_STACKS answer the arbiter will read: every py-spy ``stack`` text cut to
    ``per_text`` characters (the arbiter reads the first frames of each process's first
    threads, well inside that), then processes left out from the end until the JSON is
    at most ``limit`` characters (a larger message is read as a capture without frames).
    """
    def clip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (v[:per_text] if k == "stack" and isinstance(v, str) else clip(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [clip(v) for v in node]
        return node

    data = clip(captured)
    text = json.dumps(data, default=str)
    procs = data.get("processes") if isinstance(data, dict) else None
    while len(text) > limit and isinstance(procs, list) and procs:
        procs.pop()
        data["left_out"] = data.get("left_out", 0) + 1
        text = json.dumps(data, default=str)
    if len(text) > limit:
        return json.dumps({"error": f"stacks of {len(text)} characters, over {limit}"})
    return text


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(c for c in range(256) if c not in _BRACKETS)
_OPENS = bytes.maketrans(b"{}", b"[]")
_STEP = [0] * 256
_STEP[ord("[")], _STEP[ord("]")] = 1, -1


def too_deep(text: str, limit: int) -> bool:
    """Does JSON ``text`` nest ``[``/``{`` deeper than ``limit``? Without parsing it (a
    recursive parser is what deep nesting attacks), linear and mostly at C speed: strings
    out, brackets kept, then a run of ``limit + 1`` openers or the running depth. Fewer
    brackets than ``limit`` cannot nest deeper: no work."""
    if text.count("[") + text.count("{") <= limit:
        return False
    raw = _JSON_STRING.sub("", text).encode("utf-8", "replace")
    b = raw.translate(_OPENS, _NOT_BRACKETS)
    if b"[" * (limit + 1) in b:
        return True
    return max(accumulate(map(_STEP.__getitem__, b)), default=0) > limit


def check_fault(m: pb.Fault) -> None:
    """Raises ValueError (``limits.OutOfRange``: the fault is recorded as unusable) for
    fields out of range. Each bound is compared here, in line; a failing one is named by
    ``limits``' own check (its message says the field and the range)."""
    if not (m.id and len(m.id) <= limits.MAX_ID and m.id.isprintable()):
        limits.check_name("fault id", m.id, limits.MAX_ID, required=True)
    if not 0 <= m.generation <= limits.MAX_GENERATION:
        limits.check_int("fault generation", m.generation, 0, limits.MAX_GENERATION)
    if len(m.message) > limits.MAX_MESSAGE:
        raise limits.OutOfRange(f"fault message is {len(m.message)} characters long; at "
                                f"most {limits.MAX_MESSAGE}")
    if len(m.evidence_json) > limits.MAX_EVIDENCE:
        raise limits.OutOfRange(f"fault evidence is {len(m.evidence_json)} bytes; at most "
                                f"{limits.MAX_EVIDENCE}")
    if not math.isfinite(m.detected_at):
        raise limits.OutOfRange("fault detected_at is not finite")


def checked_fault(m: pb.Fault) -> Fault:
    """A peer's fault, its fields bounded (``check_fault``) before it is converted
    (``fault_from_proto``): one call where a fault enters the arbiter (an agent's, a
    spare's). ValueError for an unusable one."""
    check_fault(m)
    return fault_from_proto(m)


def fault_from_proto(m: pb.Fault) -> Fault:
    """The model Fault; raises ValueError when it lacks an id or a kind."""
    if not m.id:
        raise ValueError("fault without an id")
    kind = _enum(FaultKind, pb.FaultKind, m.kind, "FAULT_KIND_")
    if kind is None:
        raise ValueError(f"fault {m.id} has no known kind ({m.kind})")
    severity = _enum(Severity, pb.Severity, m.severity, "SEVERITY_") or Severity.ERROR
    scope = _enum(Scope, pb.Scope, m.scope, "SCOPE_") or Scope.PROCESS
    evidence: dict[str, Any] = {}
    if m.evidence_json and too_deep(m.evidence_json, limits.MAX_EVIDENCE_DEPTH):
        # json.loads recurses once per level: before, a traceback past ~1000 levels and no
        # acknowledgement; now the fault stands and its evidence says why it has none
        evidence = {"error": f"evidence nested deeper than {limits.MAX_EVIDENCE_DEPTH} "
                             "levels: dropped"}
    elif m.evidence_json:
        try:
            loaded = json.loads(m.evidence_json)
            evidence = loaded if isinstance(loaded, dict) else {"value": loaded}
        except (ValueError, RecursionError):
            evidence = {"raw": m.evidence_json[:4000]}
    message = m.message if m.message.isprintable() else limits.printable(m.message)
    return Fault(kind=kind, message=message, severity=severity, scope=scope,
                 evidence=evidence, id=m.id, detected_at=m.detected_at)


def progress_to_proto(p: Progress, seconds_since_progress: float, hung: bool,
                      ts: float) -> pb.ProgressSummary:
    """The wire summary, clamped to the limits the arbiter checks (a trainer that prints
    step 10**30 must not make its agent's reports unsendable)."""
    msg = pb.ProgressSummary(
        step=min(max(p.step, -1), limits.MAX_STEP),
        samples_per_second=_rate(p.samples_per_second),
        tokens_per_second=_rate(p.tokens_per_second),
        seconds_since_progress=_rate(seconds_since_progress), hung=hung, ts=ts)
    if p.loss is not None and not math.isinf(p.loss):
        msg.loss = p.loss
    return msg


def fill_step_times(msg: pb.ProgressSummary, step_seconds: float, collective_seconds: float,
                    data_seconds: float, timed_steps: int) -> None:
    """Where a step's time goes (means per step, ``timed_steps`` steps), within the limits
    the arbiter checks: each finite, in [0, MAX_SECONDS], waits at most the step."""
    step = min(_rate(step_seconds), limits.MAX_SECONDS)
    msg.step_seconds = step
    msg.collective_seconds = min(_rate(collective_seconds), step)
    msg.data_seconds = min(_rate(data_seconds), step)
    msg.timed_steps = min(max(timed_steps, 0), limits.MAX_TIMED_STEPS)


RESUME_SOURCES = ("memory", "peer", "disk")  # where ftagent.checkpoint found the state


def fill_resume_and_phases(msg: pb.ProgressSummary, resumed: int | None,
                           checkpoint_seconds: float, other_phase_seconds: float, *,
                           source: str = "") -> None:
    """The step the trainer resumed after (None: it did not say), where its state came
    from (``RESUME_SOURCES``, "" : not said) and its seconds in declared phases, within
    the limits the arbiter checks."""
    if resumed is not None and 0 <= resumed <= limits.MAX_STEP:
        msg.resumed_step = resumed
        if source in RESUME_SOURCES:
            msg.resume_source = source
    msg.checkpoint_seconds = min(_rate(checkpoint_seconds), limits.MAX_TOTAL_SECONDS)
    msg.other_phase_seconds = min(_rate(other_phase_seconds), limits.MAX_TOTAL_SECONDS)


def _rate(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) and v >= 0 else 0.0


_ACTION_KINDS = {
    pb.COMMAND_KIND_RESTART: ActionKind.RESTART,
    pb.COMMAND_KIND_STOP: ActionKind.STOP,
    pb.COMMAND_KIND_DUMP_STACKS: ActionKind.DUMP_STACKS,
    pb.COMMAND_KIND_REPLACE: ActionKind.REPLACE,
    pb.COMMAND_KIND_BUSY: ActionKind.BUSY,
    pb.COMMAND_KIND_LAST_WORDS: ActionKind.LAST_WORDS,
}


def command_to_action(cmd: pb.Command) -> Action | None:
    """The model Action a command asks of the supervisor (None: not an Action, or unknown)."""
    kind = _ACTION_KINDS.get(cmd.kind)
    if kind is None:
        return None
    return Action(
        kind=kind, reason=cmd.reason, generation=cmd.generation,
        exit_code=cmd.exit_code if cmd.HasField("exit_code") else None,
        target_rank=cmd.target_rank if cmd.HasField("target_rank") else None,
        fault_id=cmd.fault_id or None, id=cmd.id,
        restarts=cmd.restarts if cmd.HasField("restarts") else None,
        resume_step=cmd.resume_step if cmd.HasField("resume_step")
        and 0 <= cmd.resume_step <= limits.MAX_STEP else None,
        busy=busy_from_proto(cmd.busy) if kind is ActionKind.BUSY else None)


MAX_BUSY_RANKS = 64  # ranks named in one JobBusy (a verdict names a few; the rest wait)
_STATE = re.compile(r"\w{1,16}")


def busy_to_proto(b: JobBusy) -> pb.JobBusy:
    return pb.JobBusy(busy_ranks=b.busy_ranks[:MAX_BUSY_RANKS],
                      waiting_ranks=b.waiting_ranks[:MAX_BUSY_RANKS],
                      where=b.where[:limits.MAX_WHERE], state=b.state,
                      spin_culprits=b.spin_culprits[:MAX_BUSY_RANKS])


def busy_from_proto(m: pb.JobBusy) -> JobBusy:
    """A JobBusy as an agent takes it: bounded, ranks in range, a state that is a word."""

    def ranks(rs: Any) -> tuple[int, ...]:
        return tuple(r for r in list(rs)[:MAX_BUSY_RANKS] if 0 <= r < limits.MAX_WORLD_SIZE)

    return JobBusy(busy_ranks=ranks(m.busy_ranks), waiting_ranks=ranks(m.waiting_ranks),
                   where=m.where[:limits.MAX_WHERE],
                   state=m.state if _STATE.fullmatch(m.state) else "",
                   spin_culprits=ranks(m.spin_culprits))


def _enum(cls: Any, wire: Any, value: int, prefix: str) -> Any:
    """The model enum member for a wire value; None for unset or unknown (newer sender)."""
    try:
        name = wire.Name(value)
    except ValueError:
        return None
    return cls.__members__.get(name.removeprefix(prefix))
