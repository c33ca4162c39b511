"""Leader election through a ``coordination.k8s.io/v1`` Lease, as client-go does it.

Two arbiter replicas run; only the one holding the Lease acts and serves agents. The rules
are client-go's ``leaderelection`` (kube-scheduler's ``--leader-elect-*`` flags):

* the Lease's ``spec`` is the record: ``holderIdentity``, ``leaseDurationSeconds``,
  ``acquireTime``, ``renewTime``, ``leaseTransitions``;
* a candidate takes the Lease when it does not exist, has no holder, or has not changed
  for ``leaseDurationSeconds`` *as seen on this candidate's own monotonic clock* (the time
  it last saw the record change: clocks of two machines are never compared);
* the leader renews every ``retry period``; if no renewal succeeds for ``renew deadline``
  it steps down at once (before the lease can expire for the others: the deadline is
  shorter than the duration, so two leaders never act at the same time);
* every write carries the resourceVersion read, so of two candidates one wins and the
  other's 409 Conflict sends it back to reading;
* a leader that stops cleanly releases the Lease (empty holder, 1 s duration), so the
  follower takes over at its next try instead of after the whole duration.

``Election`` is the pure decision core (``now`` passed in, no I/O): tests drive it with a
fake clock. ``LeaderElector`` is the I/O loop: its own thread, the real ``kubernetes``
client, and the two transitions handed to the asyncio loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger("ftagent.kube.lease")

# kube-scheduler's defaults: 15 s, 10 s, 2 s.
LEASE_DURATION = 15.0
RENEW_DEADLINE = 10.0
RETRY_PERIOD = 2.0
JITTER = 1.2  # client-go's JitterFactor: a follower's tries spread over 1..1.2 periods
MAX_IDENTITY = 128
MAX_LEASE_BYTES = 64 * 1024  # a Lease bigger than this is not one we can trust


def identity(environ: dict[str, str] | None = None) -> str:
    """This candidate's name: the pod's name (POD_NAME, else the host name, which is the
    pod's name in Kubernetes) plus a random part, so a restarted container is a new
    candidate (kube-scheduler: ``hostname_uuid``)."""
    env = os.environ if environ is None else environ
    who = env.get("POD_NAME") or socket.gethostname() or "arbiter"
    return f"{who[:MAX_IDENTITY - 9]}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ElectionConfig:
    name: str = "ftagent-arbiter"
    namespace: str = "ftagent-system"
    identity: str = ""
    lease_duration: float = LEASE_DURATION
    renew_deadline: float = RENEW_DEADLINE
    retry_period: float = RETRY_PERIOD

    def problem(self) -> str:
        """Why these durations cannot elect safely ("" when they can), as client-go checks."""
        if self.lease_duration <= self.renew_deadline:
            return (f"--leader-elect-lease-duration ({self.lease_duration:g}) must be "
                    f"greater than --leader-elect-renew-deadline ({self.renew_deadline:g})")
        if self.renew_deadline <= JITTER * self.retry_period:
            return (f"--leader-elect-renew-deadline ({self.renew_deadline:g}) must be greater "
                    f"than {JITTER:g} x --leader-elect-retry-period ({self.retry_period:g})")
        if self.lease_duration < 1:
            return "--leader-elect-lease-duration must be at least 1 second"
        return ""


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec (client-go's LeaderElectionRecord)."""

    holder: str = ""
    duration: int = 0  # leaseDurationSeconds
    acquire_time: str = ""  # MicroTime, RFC 3339 with microseconds (informative only)
    renew_time: str = ""
    transitions: int = 0

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {"holderIdentity": self.holder,
                               "leaseDurationSeconds": self.duration,
                               "leaseTransitions": self.transitions}
        if self.acquire_time:
            out["acquireTime"] = self.acquire_time
        if self.renew_time:
            out["renewTime"] = self.renew_time
        return out

    @classmethod
    def from_spec(cls, spec: Any) -> LeaseRecord:
        """A Lease spec as read (fields may be missing or of the wrong type: they count as
        absent; a holder we cannot read is still a holder)."""
        if not isinstance(spec, dict):
            return cls()

        def num(key: str) -> int:
            v = spec.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 \
                else 0

        holder = spec.get("holderIdentity")
        return cls(holder=holder[:MAX_IDENTITY * 2] if isinstance(holder, str) else "",
                   duration=num("leaseDurationSeconds"),
                   acquire_time=_str(spec.get("acquireTime")),
                   renew_time=_str(spec.get("renewTime")),
                   transitions=num("leaseTransitions"))


def _str(v: Any) -> str:
    return v[:64] if isinstance(v, str) else ""


def micro_time(wall: float) -> str:
    return datetime.fromtimestamp(wall, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Plan:
    """What a try does: write ``record`` (create when ``create``), or nothing (``None``)."""

    record: LeaseRecord | None
    create: bool = False
    why: str = ""


class Election:
    """client-go's ``tryAcquireOrRenew`` and its renew deadline, without I/O.

    Call ``plan(current, now, wall)`` with the Lease as just read (None: it does not
    exist), write what it says, then ``written(record, now)`` or ``failed(now)``.
    ``now`` is a monotonic clock, ``wall`` the time written into the record.
    """

    def __init__(self, cfg: ElectionConfig) -> None:
        self.cfg = cfg
        self.observed: LeaseRecord | None = None
        self.observed_at = 0.0  # monotonic time the record last changed, as we saw it
        self.leading = False
        self.renewed_at = 0.0  # monotonic time of our last successful write as leader

    def _observe(self, current: LeaseRecord, now: float) -> None:
        if current != self.observed:
            self.observed = current
            self.observed_at = now

    def plan(self, current: LeaseRecord | None, now: float, wall: float) -> Plan:
        me = self.cfg.identity
        stamp = micro_time(wall)
        duration = max(1, round(self.cfg.lease_duration))
        if current is None:
            return Plan(LeaseRecord(me, duration, stamp, stamp, 0), create=True,
                        why="no lease yet")
        self._observe(current, now)
        held_by_me = current.holder == me
        if current.holder and not held_by_me:
            expires = self.observed_at + current.duration
            if now < expires:
                return Plan(None, why=f"held by {current.holder} for another "
                                      f"{expires - now:.1f}s")
        if held_by_me and self.leading:
            rec = replace(current, duration=duration, renew_time=stamp)
            return Plan(rec, why="renew")
        transitions = current.transitions + (1 if current.holder != me else 0)
        if not current.holder:
            why = "free"
        elif held_by_me:
            why = "held under our name by an earlier run"
        else:
            why = f"expired (held by {current.holder})"
        return Plan(LeaseRecord(me, duration, stamp, stamp, transitions), why=why)

    def written(self, record: LeaseRecord, now: float) -> bool:
        """A planned write succeeded; returns True when this makes us the leader."""
        self._observe(record, now)
        self.renewed_at = now
        became = not self.leading
        self.leading = True
        return became

    def failed(self, now: float) -> bool:
        """A try failed (read error, conflict, API down); True when the leader must step
        down now: no renewal for ``renew_deadline``."""
        if self.leading and now - self.renewed_at >= self.cfg.renew_deadline:
            self.leading = False
            return True
        return False

    def must_step_down(self, now: float) -> bool:
        """The same deadline, checked while a try is still in flight."""
        return self.failed(now)

    def request_timeout(self, now: float) -> float:
        """Seconds one API call may take: as leader, never past the renew deadline."""
        if not self.leading:
            return max(1.0, self.cfg.retry_period)
        left = self.renewed_at + self.cfg.renew_deadline - now
        return max(0.2, min(self.cfg.retry_period, left))

    def wait(self, rng: random.Random) -> float:
        """Seconds before the next try: the retry period, jittered for a follower."""
        if self.leading:
            return self.cfg.retry_period
        return self.cfg.retry_period * rng.uniform(1.0, JITTER)

    def release(self, current: LeaseRecord, wall: float) -> LeaseRecord | None:
        """The record that gives the Lease up (None when it is not ours to give)."""
        if current.holder != self.cfg.identity:
            return None
        return replace(current, holder="", duration=1, renew_time=micro_time(wall))


# --------------------------------------------------------------------------- I/O


class Conflict(Exception):
    """409: someone wrote the Lease since we read it (or created it first)."""


class LeaseApi:
    """The three calls on the Lease, through the real ``kubernetes`` client (raw JSON in
    and out, so what the server sends is read by us and bounded here)."""

    def __init__(self, api_client: Any, cfg: ElectionConfig) -> None:
        from kubernetes import client

        self.api: Any = client.CoordinationV1Api(api_client)
        self.name = cfg.name
        self.namespace = cfg.namespace

    def read(self, timeout: float) -> tuple[LeaseRecord, str] | None:
        """(record, resourceVersion), None when there is no Lease; raises on errors."""
        from kubernetes.client.rest import ApiException

        try:
            resp = self.api.read_namespaced_lease(self.name, self.namespace,
                                                  _preload_content=False,
                                                  _request_timeout=timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        data = resp.data
        if len(data) > MAX_LEASE_BYTES:
            raise ValueError(f"the Lease is {len(data)} bytes: not a Lease")
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("the Lease is not a JSON object")
        meta = obj.get("metadata")
        version = _str(meta.get("resourceVersion")) if isinstance(meta, dict) else ""
        return LeaseRecord.from_spec(obj.get("spec")), version

    def write(self, record: LeaseRecord, version: str, create: bool, timeout: float) -> None:
        from kubernetes.client.rest import ApiException

        body: dict[str, Any] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": record.spec()}
        try:
            if create:
                self.api.create_namespaced_lease(self.namespace, body,
                                                 _preload_content=False,
                                                 _request_timeout=timeout)
            else:
                body["metadata"]["resourceVersion"] = version
                self.api.replace_namespaced_lease(self.name, self.namespace, body,
                                                  _preload_content=False,
                                                  _request_timeout=timeout)
        except ApiException as e:
            if e.status in (409,):
                raise Conflict(e.reason or "conflict") from None
            raise


def describe_error(e: BaseException) -> str:
    status = getattr(e, "status", None)
    if status == 403:
        return ("forbidden (403): the arbiter's service account needs get, create and "
                "update on leases.coordination.k8s.io in its namespace")
    if status:
        return f"HTTP {status} {getattr(e, 'reason', '') or ''}".strip()
    return f"{type(e).__name__}: {e}"[:300]


class LeaderElector:
    """Campaigns in its own thread; calls ``on_lead`` / ``on_lose`` on ``loop``.

    Never raises into the loop: API errors are tries that failed (one log line per run
    of failures). ``stop()`` releases the Lease when we hold it.
    """

    def __init__(self, api: LeaseApi, cfg: ElectionConfig, loop: asyncio.AbstractEventLoop,
                 on_lead: Callable[[], Any], on_lose: Callable[[], Any], *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.api = api
        self.election = Election(cfg)
        self.cfg = cfg
        self.loop = loop
        self.on_lead = on_lead
        self.on_lose = on_lose
        self.clock = clock
        self.wall = wall
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._rng = random.Random()
        self._failing = ""
        self._last_wait = ""
        self.transitions = 0  # times this process became leader

    @property
    def leading(self) -> bool:
        return self.election.leading

    def start(self) -> None:
        log.info("leader election: campaigning for lease %s/%s as %s (duration %gs, renew "
                 "deadline %gs, retry %gs)", self.cfg.namespace, self.cfg.name,
                 self.cfg.identity, self.cfg.lease_duration, self.cfg.renew_deadline,
                 self.cfg.retry_period)
        self._thread.start()

    def _hand(self, fn: Callable[[], Any]) -> None:
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(fn)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._try()
            self._stop.wait(self.election.wait(self._rng))

    def _try(self) -> None:
        e = self.election
        with self._lock:
            if self._stop.is_set():
                return
            try:
                got = self.api.read(e.request_timeout(self.clock()))
                current = None if got is None else got[0]
                version = "" if got is None else got[1]
                plan = e.plan(current, self.clock(), self.wall())
                if plan.record is None:
                    self._note_wait(current)
                    self._recovered()
                    return
                if e.must_step_down(self.clock()):
                    self._lost("renew deadline passed while reading the lease")
                    return
                self.api.write(plan.record, version, plan.create,
                               e.request_timeout(self.clock()))
            except Conflict:
                self._failed("conflict (someone else wrote the lease first)")
                return
            except Exception as ex:  # API down, 5xx, 403, garbage: a try that failed
                self._failed(describe_error(ex))
                return
            self._recovered()
            if e.written(plan.record, self.clock()):
                self.transitions += 1
                log.warning("leader election: became leader of lease %s/%s (%s)",
                            self.cfg.namespace, self.cfg.name, plan.why)
                self._hand(self.on_lead)

    def _note_wait(self, current: LeaseRecord | None) -> None:
        holder = current.holder if current else ""
        if holder != self._last_wait:
            self._last_wait = holder
            log.info("leader election: lease %s/%s is held by %s; standing by",
                     self.cfg.namespace, self.cfg.name, holder)

    def _failed(self, why: str) -> None:
        if why != self._failing:
            self._failing = why
            log.warning("leader election: lease %s/%s: %s", self.cfg.namespace,
                        self.cfg.name, why)
        if self.election.failed(self.clock()):
            self._lost(f"no renewal for {self.cfg.renew_deadline:g}s ({why})")

    def _lost(self, why: str) -> None:
        self.election.leading = False
        log.error("leader election: lost lease %s/%s: %s; stopping at once",
                  self.cfg.namespace, self.cfg.name, why)
        self._hand(self.on_lose)

    def _recovered(self) -> None:
        if self._failing:
            log.info("leader election: lease %s/%s reachable again", self.cfg.namespace,
                     self.cfg.name)
            self._failing = ""

    def stop(self, release: bool = True) -> None:
        """Stop campaigning; give the Lease up when we hold it (best effort, one try)."""
        self._stop.set()
        with self._lock:
            was = self.election.leading
            self.election.leading = False
            if not (was and release):
                return
            try:
                got = self.api.read(2.0)
                if got is not None:
                    rec = self.election.release(got[0], self.wall())
                    if rec is not None:
                        self.api.write(rec, got[1], False, 2.0)
                        log.info("leader election: released lease %s/%s",
                                 self.cfg.namespace, self.cfg.name)
            except Exception as ex:
                log.warning("leader election: could not release lease %s/%s: %s",
                            self.cfg.namespace, self.cfg.name, describe_error(ex))

    def join(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)
