"""When a fault began, from what its detector measured (the goodput ledger's onset).

The ledger's ``detection`` runs from a fault's onset to the agent's fault. Many faults
are reported after they began: a hang once its budget ran out, a link once its grace
did, a GPU fault once its Xid was read. Their detectors say how long before: this module
reads that from the fault's evidence, believing numbers only, and bounded; the ledger
then clamps the result into the training the fault interrupts. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

MAX_LEAD = 7 * 24 * 3600.0  # an onset claimed further before its detection: not believed


def onset_of(kind: str, detected: float, evidence: Mapping[str, object]) -> float | None:
    """When a fault began, from what its detector measured (None: not said, take its
    detection): a hang, ``seconds_since_progress`` before its detection (the last step its
    agent saw); a link, its ``detection_latency_seconds`` (down -> fault) or, once back,
    its ``outage_seconds``; a GPU, the Xid's ``first_seen_wall``. Values from the agent:
    a number, not negative, at most ``MAX_LEAD`` before ``detected`` (the ledger clamps
    the result into the training it interrupts)."""
    lead: object = None
    if kind == "hang":
        lead = evidence.get("seconds_since_progress")
    elif kind == "nic":
        lead = evidence.get("outage_seconds" if evidence.get("recovered") is True
                            else "detection_latency_seconds")
    elif kind == "gpu":
        first = evidence.get("first_seen_wall")
        if _number(first):
            assert isinstance(first, (int, float))
            lead = detected - first
    if not _number(lead) or not math.isfinite(detected):
        return None
    assert isinstance(lead, (int, float))
    return detected - min(max(float(lead), 0.0), MAX_LEAD)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
