"""NIC debounce: link events in, NIC faults out. Pure: time comes from the events and ``tick``.

A link that goes down and comes back within ``grace`` seconds is a *flap*: counted per
device (``ftagent_nic_flaps``) and logged, but not a fault -- gloo and NCCL ride out a
short outage (the step stalls, then continues). A link still down after ``grace`` is one
``Fault(kind=NIC)``; when it comes back, a second, INFO-severity fault with
``evidence["recovered"] = True`` and the outage's length tells the arbiter that a
restart can now succeed. Nothing is reported twice for one outage.

Per device::

    (never up) --up--> UP --down--> DOWN --up within grace--> UP     (flaps += 1)
                                     |
                                     +--grace expires (tick)--> FAULTED --up--> UP
                                        Fault(ERROR)                 Fault(INFO, recovered)

A link that has never been up since the agent started is not in use by the job: its
state is kept (metrics show it) but it is never judged, so an unused port that is down
at start raises nothing. Down has three reasons, decided from flags, not from the
operstate text: ``admin_down`` (IFF_UP clear), ``carrier_lost`` (up, no IFF_LOWER_UP)
and ``deleted`` (RTM_DELLINK, a rename, or an RDMA port that vanished).

A link the job did not name (``guessed``: watched only because it was up when the agent
started -- no ``--nic``, ``NCCL_SOCKET_IFNAME`` or ``GLOO_SOCKET_IFNAME``) may be anyone's:
on a host shared with other containers or tests, their veths and bridges are up at start
and are deleted or downed with their owners. Its outage is a WARNING (recorded, acted on by
nobody) while another guessed link is still up, and its recovery is not reported; only
when every guessed link judged so far is down is it the ERROR that makes the arbiter wait
for the link (and defer the job's crashes meanwhile). Before, another tenant's veth
deleted on the node deferred this job's next crash for ``--nic-replace-after`` (300 s):
the job sat still, then was restarted or its rank replaced. The preflight judges guessed
links the same way (agent/preflight.py).

Grace expiry is noticed by ``tick(now)`` (the agent calls it ~4 times a second;
``next_deadline()`` lets a caller sleep exactly until the next expiry instead), and also
by ``observe`` itself, so a late tick never hides an outage longer than the grace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ftagent.model import Fault, FaultKind, LinkEvent, Observation, Scope, Severity

log = logging.getLogger("ftagent.detect.nic")

REASON_TEXT = {
    "admin_down": "is administratively down",
    "carrier_lost": "lost carrier",
    "deleted": "was deleted",
}


def down_reason(ev: LinkEvent) -> str | None:
    """Why a link is down ("admin_down" | "carrier_lost" | "deleted"), or None if it is up."""
    if ev.deleted:
        return "deleted"
    if not ev.admin_up:
        return "admin_down"
    if not ev.carrier:
        return "carrier_lost"
    return None


@dataclass(frozen=True)
class LinkStatus:
    """What the detector knows about one device (``state(device)``)."""

    device: str
    up: bool
    reason: str | None = None  # why it is down, None while up
    down_since: float | None = None  # monotonic ts of the event that took it down
    faulted: bool = False  # a fault was raised for the current outage
    warned: bool = False  # ... as a WARNING only (a guessed link; others were up)
    judged: bool = False  # has been up since the agent started (only then faults)
    flaps: int = 0
    outages: int = 0  # outages longer than the grace
    operstate: str = ""
    index: int = 0


class NicDetector:
    """Debounces :class:`LinkEvent`s of every watched link (netlink links and RDMA ports).

    ``grace``: a link down shorter than this is a flap. ``scope``: POD for an agent in
    the pod's network namespace, NODE for a host-network agent (``ftagent node`` or a
    hostNetwork pod), where a dead link is the node's. ``wall`` converts evidence
    timestamps for humans; it is injected so tests stay deterministic. ``guessed(device)``:
    the device is watched only as a link up at start (module docstring).
    """

    def __init__(self, grace: float = 2.0, *, scope: Scope = Scope.POD,
                 wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 guessed: Callable[[str], bool] = lambda _: False) -> None:
        if grace < 0:
            raise ValueError("grace must be >= 0")
        self.grace = grace
        self.scope = scope
        self._guessed = guessed  # a link watched only as one up at start (NicSource.guessed)
        self._wall = wall
        self._monotonic = monotonic
        self._links: dict[str, LinkStatus] = {}

    # ------------------------------------------------------------------ queries

    def state(self, device: str) -> LinkStatus | None:
        return self._links.get(device)

    def flaps(self, device: str) -> int:
        st = self._links.get(device)
        return st.flaps if st else 0

    def devices(self) -> list[str]:
        return sorted(self._links)

    def next_deadline(self) -> float | None:
        """The monotonic time the earliest pending grace expires, or None if none is pending."""
        pending = [st.down_since + self.grace for st in self._links.values()
                   if st.down_since is not None and st.judged and not st.faulted]
        return min(pending) if pending else None

    # ------------------------------------------------------------------ inputs

    def observe(self, obs: Observation) -> list[Fault]:
        """Take one observation; only :class:`LinkEvent`s matter here."""
        if not isinstance(obs, LinkEvent):
            return []
        ev = obs
        faults = self._expire(ev.ifname, ev.ts)  # an outage past its grace, seen late
        prev = self._links.get(ev.ifname) or LinkStatus(device=ev.ifname, up=False)
        reason = down_reason(ev)
        cur = replace(prev, operstate=ev.operstate, index=ev.index or prev.index)
        if reason is None:
            cur = replace(cur, up=True, reason=None, down_since=None, faulted=False,
                          warned=False, judged=True)
            if prev.down_since is not None and prev.judged:
                outage = max(0.0, ev.ts - prev.down_since)
                if prev.warned:  # nobody waits for it: its recovery is no news
                    log.info("link %s is back after %.1fs", ev.ifname, outage)
                elif prev.faulted:
                    faults.append(self._recovered(prev, outage, ev.ts))
                else:
                    cur = replace(cur, flaps=prev.flaps + 1)
                    log.info("link %s flapped: %s for %.3fs (< grace %.3gs), flap %d",
                             ev.ifname, prev.reason, outage, self.grace, cur.flaps)
        elif prev.up or prev.down_since is None:
            # a transition to down (or the first sight of a link that is down)
            cur = replace(cur, up=False, reason=reason, down_since=ev.ts, faulted=False,
                          warned=False)
            if prev.judged:
                log.info("link %s %s (operstate %s); grace %.3gs", ev.ifname,
                         REASON_TEXT[reason], ev.operstate or "?", self.grace)
            else:
                log.warning("link %s is watched but %s since the agent started; it is "
                            "judged once it has been up", ev.ifname, REASON_TEXT[reason])
        else:  # still down; the reason may change (carrier lost, then deleted)
            cur = replace(cur, reason=reason)
        self._links[ev.ifname] = cur
        return faults + self._expire(ev.ifname, ev.ts)

    def tick(self, now: float) -> list[Fault]:
        """Raise a fault for every judged link whose outage outlasted the grace by ``now``."""
        faults: list[Fault] = []
        for device in list(self._links):
            faults += self._expire(device, now)
        return faults

    # ------------------------------------------------------------------ internals

    def _expire(self, device: str, now: float) -> list[Fault]:
        st = self._links.get(device)
        if (st is None or st.down_since is None or st.faulted or not st.judged
                or now - st.down_since < self.grace):
            return []
        others = self._guessed_up(device)
        self._links[device] = replace(st, faulted=True, warned=bool(others),
                                      outages=st.outages + 1)
        return [self._down_fault(st, now, others)]

    def _guessed_up(self, device: str) -> list[str]:
        """When ``device`` is a guessed link: the other guessed links that are up (judged),
        which the job may be using instead; else (a link the job named) none."""
        if not self._guessed(device):
            return []
        return sorted(d for d, st in self._links.items()
                      if d != device and st.up and st.judged and self._guessed(d))

    def _walltime(self, mono_ts: float) -> float:
        """A monotonic timestamp on the wall clock (for the timeline and humans)."""
        return self._wall() - (self._monotonic() - mono_ts)

    def _down_fault(self, st: LinkStatus, now: float, others: list[str]) -> Fault:
        """The outage's fault: an ERROR, or a WARNING for a guessed link while ``others``
        (guessed links too) are up."""
        assert st.down_since is not None and st.reason is not None
        down_for = now - st.down_since
        extra: dict[str, object] = {}
        note = ""
        if others:
            shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more"
                                             if len(others) > 4 else "")
            note = (f"; not named as the job's link (--nic, NCCL_SOCKET_IFNAME, "
                    f"GLOO_SOCKET_IFNAME) and {shown} still up: recorded only")
            extra = {"guessed": True, "others_up": others[:16]}
        return Fault(
            kind=FaultKind.NIC,
            severity=Severity.WARNING if others else Severity.ERROR,
            scope=self.scope,
            message=(f"link {st.device} {REASON_TEXT[st.reason]} for {down_for:.1f}s "
                     f"(grace {self.grace:g}s){note}"),
            evidence={
                **extra,
                "device": st.device,
                "reason": st.reason,
                "operstate": st.operstate,
                "index": st.index,
                "down_since": st.down_since,  # monotonic, when the event arrived
                "down_since_wall": self._walltime(st.down_since),
                "detected": now,  # monotonic
                "detection_latency_seconds": down_for,
                "grace_seconds": self.grace,
                "flaps": st.flaps,
            },
        )

    def _recovered(self, st: LinkStatus, outage: float, now: float) -> Fault:
        log.info("link %s is back after %.1fs", st.device, outage)
        return Fault(
            kind=FaultKind.NIC,
            severity=Severity.INFO,
            scope=self.scope,
            message=f"link {st.device} is up again after {outage:.1f}s ({st.reason})",
            evidence={
                "device": st.device,
                "recovered": True,
                "reason": st.reason,
                "outage_seconds": outage,
                "down_since": st.down_since,
                "down_since_wall": self._walltime(st.down_since or now),
                "up_at": now,  # monotonic
                "flaps": st.flaps,
            },
        )
