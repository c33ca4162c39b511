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
from typing import Any

from ftagent.model import Action, ActionKind, Fault, FaultKind, Progress, Scope, Severity
from ftagent.v1 import ftagent_pb2 as pb

log = logging.getLogger("ftagent.wire.convert")


def fault_to_proto(f: Fault, generation: int, exit_status: int | None = None) -> pb.Fault:
    try:
        evidence = json.dumps(f.evidence, default=str)
    except (TypeError, ValueError):
        evidence = json.dumps({"unserializable": repr(f.evidence)[:2000]})
    msg = pb.Fault(
        id=f.id,
        kind="FAULT_KIND_" + f.kind.name,
        severity="SEVERITY_" + f.severity.name,
        scope="SCOPE_" + f.scope.name,
        message=f.message,
        evidence_json=evidence,
        detected_at=f.detected_at,
        generation=generation,
    )
    if exit_status is not None:
        msg.exit_status = exit_status
    return msg


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
    if m.evidence_json:
        try:
            loaded = json.loads(m.evidence_json)
            evidence = loaded if isinstance(loaded, dict) else {"value": loaded}
        except ValueError:
            evidence = {"raw": m.evidence_json[:4000]}
    return Fault(kind=kind, message=m.message, severity=severity, scope=scope,
                 evidence=evidence, id=m.id, detected_at=m.detected_at)


def progress_to_proto(p: Progress, seconds_since_progress: float, hung: bool,
                      ts: float) -> pb.ProgressSummary:
    msg = pb.ProgressSummary(
        step=p.step, samples_per_second=p.samples_per_second or 0.0,
        tokens_per_second=p.tokens_per_second or 0.0,
        seconds_since_progress=seconds_since_progress, hung=hung, ts=ts)
    if p.loss is not None:
        msg.loss = p.loss
    return msg


_ACTION_KINDS = {
    pb.COMMAND_KIND_RESTART: ActionKind.RESTART,
    pb.COMMAND_KIND_STOP: ActionKind.STOP,
    pb.COMMAND_KIND_DUMP_STACKS: ActionKind.DUMP_STACKS,
    pb.COMMAND_KIND_REPLACE: ActionKind.REPLACE,
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
        fault_id=cmd.fault_id or None, id=cmd.id)


def _enum(cls: Any, wire: Any, value: int, prefix: str) -> Any:
    """The model enum member for a wire value; None for unset or unknown (newer sender)."""
    try:
        name = wire.Name(value)
    except ValueError:
        return None
    return cls.__members__.get(name.removeprefix(prefix))
