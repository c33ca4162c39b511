"""The recovery ladder as one table: which tier carries out a decision, per fault, with
the Kubernetes version and feature gate each tier needs, falling back when absent. Pure.

The policy (policy.py) decides the verdict -- RESTART every rank, or REPLACE one rank's
pod -- and ``pick`` says how: the fastest tier of that fault's rung list that is built,
that the cluster's version has and whose gate the node declares
(``status.declaredFeatures``, NodeDeclaredFeatures, where the node publishes it).

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

A REPLACE for an unhealthy DRA device taints that device (kube/device_taint.py) instead
of cordoning its node; that is the node's fate, not a tier. restart-container and
reset-pod are *not built* (``built`` False): ``pick`` passes over
them (saying so) unless asked for the plan (``built_only=False``). Feature-gate names are
the KEPs'.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


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


TIERS: dict[Tier, TierSpec] = {s.tier: s for s in (
    TierSpec(Tier.PROCESS, "pod, node, devices, the agent's memory"),
    TierSpec(Tier.CONTAINER, "pod UID, node, devices, volumes", (1, 35),
             "ContainerRestartRules", built=False),
    TierSpec(Tier.POD_IN_PLACE, "pod UID, node, devices, emptyDir", (1, 36),
             "RestartAllContainersOnContainerExits", built=False),
    TierSpec(Tier.SPARE, "the job's other ranks, the spare's warm standby"),
    TierSpec(Tier.POD, "the job's other ranks"),
)}

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
    """What the cluster (the rank's node) has: its version, the gates it declares
    (None: the node does not say), whether a warm spare of the job is connected."""

    version: tuple[int, int] | None = None
    declared: frozenset[str] | None = None
    spare: bool = False


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
    if spec.version is not None and (f.version is None or f.version < spec.version):
        have = "an unknown version" if f.version is None else \
            f"{f.version[0]}.{f.version[1]}"
        return f"needs Kubernetes {spec.version[0]}.{spec.version[1]}, the cluster runs {have}"
    if spec.gate and (f.declared is None or spec.gate not in f.declared):
        return f"needs gate {spec.gate}, " + ("the node declares no features"
                                              if f.declared is None else "not declared")
    return ""


def rungs(verdict: str, kind: str) -> tuple[Tier, ...]:
    return LADDER.get((verdict, kind), DEFAULT.get(verdict, (Tier.POD,)))


def pick(verdict: str, kind: str, f: Features, built_only: bool = True
         ) -> tuple[Tier, str]:
    """The tier for a ``verdict`` ("restart" or "replace") of a ``kind`` fault, and why:
    the fastest usable rung; each one passed over is named with its reason. The last rung
    (replace-pod) is always usable: the fallback of every ladder."""
    skipped: list[str] = []
    ladder = rungs(verdict, kind)
    for t in ladder:
        why = usable(TIERS[t], f, built_only) if t is not ladder[-1] else ""
        if not why:
            return t, (f"{t.value}" + (f" ({'; '.join(skipped)})" if skipped else ""))
        skipped.append(f"{t.value}: {why}")
    return Tier.POD, "replace-pod"


def table(tiers: Iterable[TierSpec] = TIERS.values()) -> list[tuple[str, str, str, str, str]]:
    """The ladder as rows (tier, keeps, version, gate, built) for docs and status."""
    return [(s.tier.value, s.keeps, f"{s.version[0]}.{s.version[1]}" if s.version else "any",
             s.gate or "-", "yes" if s.built else "no") for s in tiers]
