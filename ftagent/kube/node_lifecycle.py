"""Planned disruptions of a node (KEP-5683 node lifecycle conditions, a drain by another
system) -> what the arbiter records and what it leaves alone. Pure: a node object in.

* A lifecycle condition that is True (``DrainInProgress``, ``MaintenancePlanned``, ...)
  is a *planned* event, not a fault: the arbiter notes it on the timeline of every job
  with ranks on the node, once per transition; nothing restarts because of it.
* A node another system already holds -- one of those conditions True, or cordoned
  (``spec.unschedulable``) without ftagent's own annotation -- is never cordoned again by
  ftagent: a REPLACE there deletes the pod and leaves the node to its owner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftagent.kube.cluster_faults import get, text

# KEP-5683's conditions (alpha in 1.37), names as the KEP gives them
LIFECYCLE = ("DrainInProgress", "MaintenancePlanned", "MaintenanceInProgress")
MAX_CONDITIONS = 64
CORDONED_BY = "ftagent.io/cordoned-by"


@dataclass(frozen=True)
class Planned:
    type: str
    reason: str
    message: str
    since: str  # lastTransitionTime, as the node says it (the transition's key)


def planned(node: Any) -> list[Planned]:
    """The node's lifecycle conditions that are True (bounded, odd entries skipped)."""
    conds = get(node, "status", "conditions")
    if not isinstance(conds, list):
        return []
    out = []
    for c in conds[:MAX_CONDITIONS]:
        if isinstance(c, Mapping) and c.get("type") in LIFECYCLE and c.get("status") == "True":
            out.append(Planned(str(c["type"]), text(c.get("reason")), text(c.get("message")),
                               text(c.get("lastTransitionTime"), 40)))
    return out


def held_by_other(node: Any) -> str:
    """Why another system holds ``node`` ('' when none does): a lifecycle condition True,
    or a cordon that is not ftagent's."""
    got = planned(node)
    if got:
        return f"{got[0].type} on the node ({got[0].reason or 'no reason given'})"
    notes = get(node, "metadata", "annotations")
    ours = isinstance(notes, Mapping) and notes.get(CORDONED_BY) == "ftagent-arbiter"
    if get(node, "spec", "unschedulable") is True and not ours:
        return "cordoned by someone else (a drain or its operator)"
    return ""
