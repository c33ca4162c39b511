"""The recovery ladder as one table: which tier carries out a decision, per fault, with
the Kubernetes version and feature gate each tier needs, falling back when absent. Pure.

The policy (policy.py) decides the verdict -- RESTART every rank, or REPLACE one rank's
pod -- and ``pick`` says how: the fastest tier of that fault's rung list that is built,
that the rank's pod carries the restart rule for (the webhook's, kept by the API server:
its gate is on there) and whose gate the rank's node has -- declared in
``status.declaredFeatures`` (NodeDeclaredFeatures) where the node publishes it, else read
from its kubelet's version (``status.nodeInfo.kubeletVersion``: beta gates are on from
their beta release).

================== ======================================= ======= ==========================
tier               keeps                                   version gate
================== ======================================= ======= ==========================
restart-process    pod, node, devices, the agent's memory  any     -
restart-container  pod UID, node, devices, volumes         1.35    ContainerRestartRules
                                                                     (KEP-5307)
reset-pod          pod UID, node, devices, emptyDir        1.36    RestartAllContainers-
                                                                     OnContainerExits (5532)
replace-onto-spare the other ranks, the spare's standby    any     -
replace-pod        the other ranks                         any     -
================== ======================================= ======= ==========================

When each is picked (``carry_out``): a RESTART whose culprit rank was also the culprit of
the restart that began this generation (``Features.repeats``: a process restart did not
clear it) passes over restart-process to the pod-level tiers -- reset-pod first where the
fault's rungs list it before restart-container (a hang, an application Xid: the device
state the init containers set up is suspect) -- and stays a process restart, saying why,
where neither is usable. The rank's agent then exits with ``EXIT_RESET_POD`` or
``EXIT_RESTART_CONTAINER`` (model.py) and the kubelet restarts it in place; the other
ranks restart their process; the barrier waits for the rank to come back from the same
pod. A REPLACE for an unhealthy DRA device taints that device (kube/device_taint.py)
instead of cordoning its node; that is the node's fate, not a tier.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ftagent.arbiter.state import Verdict
from ftagent.model import EXIT_RESET_POD, EXIT_RESTART_CONTAINER


class Tier(str, enum.Enum):
    PROCESS = "restart-process"
    CONTAINER = "restart-container"
    POD_IN_PLACE = "reset-pod"
    SPARE = "replace-onto-spare"
    POD = "replace-pod"


@dataclass(frozen=True)
class TierSpec:
    tier: Tier
    keeps: str
    version: tuple[int, int] | None = None  # the Kubernetes minor it needs (None: any)
    gate: str = ""  # the feature gate it needs ("": none)
    built: bool = True
    action: str = ""  # the container restart rule's action it needs in the pod ("": none)
    exit_code: int | None = None  # what the rank's agent exits with to take it


TIERS: dict[Tier, TierSpec] = {s.tier: s for s in (
    TierSpec(Tier.PROCESS, "pod, node, devices, the agent's memory"),
    TierSpec(Tier.CONTAINER, "pod UID, node, devices, volumes", (1, 35),
             "ContainerRestartRules", action="Restart", exit_code=EXIT_RESTART_CONTAINER),
    TierSpec(Tier.POD_IN_PLACE, "pod UID, node, devices, emptyDir", (1, 36),
             "RestartAllContainersOnContainerExits", action="RestartAllContainers",
             exit_code=EXIT_RESET_POD),
    TierSpec(Tier.SPARE, "the job's other ranks, the spare's warm standby"),
    TierSpec(Tier.POD, "the job's other ranks"),
)}
# Gates a node lists in status.declaredFeatures when it has them (the kubelet's
# NodeDeclaredFeatures registry): absent from a node's list means off there. Others are
# read from the kubelet's version.
DECLARED_GATES = frozenset({"RestartAllContainersOnContainerExits"})
# A RESTART blamed on the same rank this many times in a row (consecutive generations)
# escalates past restart-process.
ESCALATE_AFTER = 1

# Per (verdict, fault kind): the tiers that may carry it out, fastest first. A REPLACE's
# fault left the pod or its node unusable: no tier keeps the node. A kind not listed
# takes its verdict's default.
LADDER: dict[tuple[str, str], tuple[Tier, ...]] = {
    ("restart", "crash"): (Tier.PROCESS, Tier.CONTAINER, Tier.POD_IN_PLACE, Tier.POD),
    ("restart", "hang"): (Tier.PROCESS, Tier.POD_IN_PLACE, Tier.POD),
    ("restart", "gpu"): (Tier.PROCESS, Tier.POD_IN_PLACE, Tier.POD),  # app-level Xid
    ("restart", "nic"): (Tier.PROCESS, Tier.POD),
    ("replace", "gpu"): (Tier.SPARE, Tier.POD),
    ("replace", "node"): (Tier.SPARE, Tier.POD),
    ("replace", "straggler"): (Tier.SPARE, Tier.POD),
}
DEFAULT = {"restart": (Tier.PROCESS, Tier.POD), "replace": (Tier.SPARE, Tier.POD)}


@dataclass(frozen=True)
class Features:
    """What one rank's pod and node have: the kubelet's version, the gates the node
    declares (None: the node does not say), the restart-rule actions the pod's rules
    give ftagent's exit codes (None: not known), whether a warm spare of the job is
    connected, and how many restarts in a row were blamed on this rank."""

    version: tuple[int, int] | None = None
    declared: frozenset[str] | None = None
    rules: frozenset[str] | None = None
    spare: bool = False
    repeats: int = 0


def parse_version(git_version: str) -> tuple[int, int] | None:
    """``v1.36.2`` / ``v1.36.0-gke.1`` -> (1, 36); None when it is not one."""
    v = git_version.strip().lstrip("v")[:40]
    parts = v.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    minor = "".join(c for c in parts[1][:4] if c.isdigit())
    return (int(parts[0]), int(minor)) if minor else None


def usable(spec: TierSpec, f: Features, built_only: bool = True) -> str:
    """'' when ``spec`` can carry a decision out here, else why not (one clause)."""
    if built_only and not spec.built:
        return "not built"
    if spec.tier is Tier.SPARE and not f.spare:
        return "no warm spare connected"
    if spec.action and (f.rules is None or spec.action not in f.rules):
        return f"the pod has no restart rule {spec.action} for exit code {spec.exit_code}"
    if spec.gate and f.declared is not None and spec.gate in f.declared:
        return ""  # the node says it has it: its version does not matter
    if spec.gate in DECLARED_GATES and f.declared is not None:
        return f"the node does not declare {spec.gate}"
    if spec.version is not None and (f.version is None or f.version < spec.version):
        have = "an unknown version" if f.version is None else \
            f"{f.version[0]}.{f.version[1]}"
        return f"needs Kubernetes {spec.version[0]}.{spec.version[1]} ({spec.gate}), " \
               f"the node's kubelet runs {have}"
    return ""


def rungs(verdict: str, kind: str) -> tuple[Tier, ...]:
    return LADDER.get((verdict, kind), DEFAULT.get(verdict, (Tier.POD,)))


def pick(verdict: str, kind: str, f: Features, built_only: bool = True
         ) -> tuple[Tier, str]:
    """The tier for a ``verdict`` ("restart" or "replace") of a ``kind`` fault, and why:
    the fastest usable rung; each one passed over is named with its reason. The last rung
    (replace-pod) is always usable: the fallback of every ladder. A RESTART escalated
    (``f.repeats``) tries only the pod-level tiers and falls back to restart-process."""
    skipped: list[str] = []
    ladder = rungs(verdict, kind)
    escalated = verdict == "restart" and f.repeats >= ESCALATE_AFTER
    if escalated:
        skipped.append(f"{Tier.PROCESS.value}: did not clear it ({f.repeats} in a row)")
        ladder = tuple(t for t in ladder if TIERS[t].action)
    for t in ladder:
        why = usable(TIERS[t], f, built_only) if t is not ladder[-1] or escalated else ""
        if not why:
            return t, (f"{t.value}" + (f" ({'; '.join(skipped)})" if skipped else ""))
        skipped.append(f"{t.value}: {why}")
    if escalated:
        return Tier.PROCESS, f"{Tier.PROCESS.value} ({'; '.join(skipped)})"
    return Tier.POD, "replace-pod"


def carry_out(d: Any, kind: str, f: Features | None) -> Any:
    """The policy's RESTART ``d`` (a ``state.Decision`` blaming one rank) as its tier
    carries it out: unchanged for restart-process; for a pod-level tier, a REPLACE of
    that rank whose agent exits with the tier's exit code (no pod deleted, no node
    cordoned: kube/cluster.py leaves an in-place REPLACE alone), its reason naming the
    tier and every rung passed over."""
    if f is None or d.rank is None or d.rank < 0:
        return d
    tier, why = pick("restart", kind, f)
    spec = TIERS[tier]
    if spec.exit_code is None:
        if tier is Tier.PROCESS and f.repeats >= ESCALATE_AFTER:
            return dataclasses.replace(d, reason=f"{d.reason}; tier {why}")
        return d
    what = "resets its pod in place" if tier is Tier.POD_IN_PLACE else \
        "restarts its container in place"
    return dataclasses.replace(
        d, verdict=Verdict.REPLACE, exit_code=spec.exit_code,
        reason=f"{d.reason}; rank {d.rank} {what} (tier {why})")


def in_place(d: Any) -> bool:
    """A REPLACE carried out in place (the pod stays: nothing to delete or cordon)."""
    return getattr(d, "exit_code", None) in (EXIT_RESTART_CONTAINER, EXIT_RESET_POD)


def table(tiers: Iterable[TierSpec] = TIERS.values()) -> list[tuple[str, str, str, str, str]]:
    """The ladder as rows (tier, keeps, version, gate, built) for docs and status."""
    return [(s.tier.value, s.keeps, f"{s.version[0]}.{s.version[1]}" if s.version else "any",
             s.gate or "-", "yes" if s.built else "no") for s in tiers]
