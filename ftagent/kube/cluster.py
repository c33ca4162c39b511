"""The arbiter in the cluster: node and pod events -> faults, decisions -> Kubernetes actions.

``Cluster`` is what ``ftagent arbiter --kube`` plugs into the registry, and the registry
never imports it: pod and node events (``on_pod``, ``on_node``, from the watches) become
faults through ``Registry.report_fault`` (``cluster_faults.py`` says which), so the policy
decides them like every fault; each executed decision comes back through the registry's
decision listener and turns into actions:

* REPLACE: delete the rank's pod -- only the pod of the verified identity as the watch
  sees it (labelled for the job, the registering pod's uid), always with its uid as a
  precondition -- so its controller recreates it; cordon + taint that pod's
  ``spec.nodeName`` only on node-scope evidence (``node_scope.py``: the node watch, the
  node's own agent, or pods of two namespaces and ServiceAccounts) and within the circuit
  breaker (``breaker.py``: the nodes held cordoned now); the other ranks restart
  in place (their commands were queued before the listener ran) and the barrier waits
  for the replacement;
* every fault decision and barrier release: an Event on the pod and the job object;
* pods of the job's ranks: annotated with their ftagent state (coalesced, latest wins);
* with --uncordon-after: ftagent's own cordon undone once the node agent has reported the
  node healthy that long (``uncordon.py``).

Everything on the loop is memory only; API calls go to two small thread pools (actions
first, Events and annotations in the background), so a slow or failing API server never
delays a decision the agents are waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ftagent.arbiter.auth import PodFacts
from ftagent.arbiter.ladder import Features, in_place
from ftagent.arbiter.registry import Registry
from ftagent.arbiter.state import Decision, JobState, Verdict
from ftagent.kube.actuator import (
    ANNOTATIONS,
    EVIDENCE_ANNOTATION,
    STATE_ANNOTATION,
    Actuator,
    Forbidden,
    GaveUp,
)
from ftagent.kube.breaker import CordonBreaker, Held
from ftagent.kube.cluster_faults import (
    ClusterFault,
    NodeFaults,
    PodFaults,
    get,
    name_of,
    parse_time,
    pending_fault,
    terminal_status,
    waits_for_a_node,
)
from ftagent.kube.device_health import DeviceHealth
from ftagent.kube.device_taint import (
    TAINT_KEY,
    Absent,
    device_key,
    rule_name,
    taint_device,
)
from ftagent.kube.dra import DraTaints
from ftagent.kube.identity import identify, literal_env, trainer_index
from ftagent.kube.membership import KIND_RANK, JobOwners, Ref, controller_ref, local_world
from ftagent.kube.node_blip import STEP_WINDOW, still_stepping
from ftagent.kube.node_lifecycle import held_by_other, planned
from ftagent.kube.node_scope import NodeEvidence
from ftagent.kube.owners import OwnerChains
from ftagent.kube.pod_tiers import Streaks, features_of
from ftagent.kube.recorder import JOB_KINDS, ObjectRef, Recorder, job_owner, pod_ref
from ftagent.kube.trainjob_status import TrainJobStatus, trainer_status
from ftagent.kube.uncordon import NodeHealth
from ftagent.model import Scope

log = logging.getLogger("ftagent.kube.cluster")
LAST_WORDS_EVERY = 60.0  # seconds between two LAST_WORDS to one job's ranks on a node

JOB_LABEL = "ftagent.io/job"  # the pod watch selects ftagent pods by this label
CONTEXT_KEPT = 10_000
# Seconds between a decision and the PATCH of its pods' state annotations (written by the
# tick, in the background): after the commands and, usually, the barrier's release.
ANNOTATE_AFTER = 1.0
ANNOTATE_RATE = 100.0  # PATCHes of pods' state annotations a second, at most
# Event reasons per decision, in the users' words (type, reason).
REASONS = {Verdict.RESTART: ("Warning", "FaultRestart"),
           Verdict.REPLACE: ("Warning", "FaultReplacePod"),
           Verdict.STOP: ("Warning", "JobStopped"),
           Verdict.ALERT_ONLY: ("Warning", "FaultRecorded"),
           Verdict.DUMP_STACKS: ("Warning", "HangCollectingStacks"),
           Verdict.WAIT: ("Warning", "LinkDownWaiting")}
# The culprits of a decision on its Events, as data (comma-separated, in rank order, the
# same ranks its message names); "" when it named none (a later occurrence of the series
# clears an earlier one's). Pods and nodes are the ones the ranks' agents registered.
CULPRIT_RANKS = "ftagent.io/culprit-ranks"
CULPRIT_PODS = "ftagent.io/culprit-pods"
CULPRIT_NODES = "ftagent.io/culprit-nodes"
CULPRIT_VERDICTS = (Verdict.RESTART, Verdict.REPLACE, Verdict.STOP)
CULPRIT_EVENT_PODS = 8  # culprit pods that get the Event themselves


def culprit_annotations(d: Decision) -> dict[str, str]:
    """The Event annotations naming ``d``'s culprits (at most 64: Decision's own bound)."""
    cs = d.culprits[:64]
    return {CULPRIT_RANKS: ",".join(str(c.rank) for c in cs),
            CULPRIT_PODS: ",".join(c.pod for c in cs),
            CULPRIT_NODES: ",".join(c.node for c in cs)}


_QUIET_STATES = ("replacing", "exited", "succeeded", "stopping")


@dataclass(frozen=True)
class KubeSettings:
    """What ``ftagent arbiter``'s --kube flags say (cmd/arbiter.py)."""

    node_notready_grace: float = 40.0
    force_delete_after: float = -1.0  # off
    max_cordon_fraction: float = 0.1
    max_cordons: int = 10  # nodes held cordoned cluster-wide on corroborated pod evidence
    node_evidence_window: float = 300.0
    pending_grace: float = 300.0
    component: str = "ftagent-arbiter"
    # seconds between two writes of a job's progress to its TrainJob (0: never)
    trainjob_status_interval: float = 30.0
    # nodes held cordoned on node evidence (its agent, its conditions): their own budget
    max_confirmed_cordons: int = 50
    # uncordon ftagent's cordon after the node agent says healthy this long (0: never)
    uncordon_after: float = 0.0


# Owners read to find a pod's job object: batch Job -> JobSet -> TrainJob (get on them)
CLIMB = {("batch", "Job"), ("jobset.x-k8s.io", "JobSet")}
MAX_OWNER_BYTES = 1 << 20


class Cluster:
    def __init__(self, registry: Registry, api_client: Any, settings: KubeSettings, *,
                 clock: Callable[[], float] = time.time, actuator: Actuator | None = None
                 ) -> None:
        self.registry, self.settings, self.clock = registry, settings, clock
        # With --leader-elect: acts only while this replica leads (a standby only keeps
        # what its watches see: no faults reported, no ticks, so it never cordons or deletes)
        self.active: Callable[[], bool] = lambda: True
        # A cordon made (node, fault kind): the arbiter counts it in its /metrics
        self.on_cordon: Callable[[str, str], None] = lambda node, kind: None
        # a cluster action that could not be carried out (cordon, delete_pod, force_delete),
        # and a cordon the breaker skipped: the arbiter's metrics count them
        self.on_action_failed: Callable[[str], None] = lambda action: None
        self.on_cordon_skipped: Callable[[], None] = lambda: None
        # a pod the watch saw deleted (namespace, name, uid): its tokens are dead
        # (kube/projected.py refuses them without asking the API server)
        self.on_pod_deleted: Callable[[str, str, str], None] = lambda ns, name, uid: None
        self.api_client = api_client
        self.actuator = actuator or Actuator(api_client, clock=clock)
        self.recorder = Recorder(api_client, self.actuator, component=settings.component,
                                 instance=registry.arbiter_id, clock=clock)
        self.breaker = CordonBreaker(settings.max_cordon_fraction,
                                     max_nodes=settings.max_cordons,
                                     max_confirmed=settings.max_confirmed_cordons)
        self.health = NodeHealth(settings.uncordon_after)
        self._uncordoning: set[str] = set()
        self._uncordoned: list[str] = []  # (from workers, under _lock)
        # DRA device taints the cluster could not take: the node's cordon instead, judged
        # on the loop (the breaker): (job key, node, kind, reason, fault id, rank)
        self._taint_fallbacks: list[tuple[tuple[str, str], str, str, str, str, Any]] = []
        self._taint_failed: list[str] = []  # device keys whose rule was never written
        # an uncordon made (node): the arbiter may count it
        self.on_uncordon: Callable[[str], None] = lambda node: None
        self.evidence = NodeEvidence(settings.node_evidence_window)
        self.nodes = NodeFaults(settings.node_notready_grace)
        self.pods = PodFaults()
        self.devices = DeviceHealth()  # device health in pod status (KEP-4680)
        self.dra = DraTaints()  # DRA device taints on ResourceSlices (KEP-5055)
        self.streaks = Streaks()  # restarts in a row blamed on one rank (the ladder's)
        # NotReady faults held back while the job's ranks there keep stepping (node_blip)
        self._blips: dict[tuple[str, tuple[str, str]], ClusterFault] = {}
        self.step_window = STEP_WINDOW  # a rank stepped within this long is alive
        self._planned_seen: OrderedDict[str, None] = OrderedDict()  # lifecycle transitions
        self._last_words_at: OrderedDict[str, float] = OrderedDict()  # job@node -> when
        self.pod_cache: dict[tuple[str, str], dict[str, Any]] = {}
        # Pods of a job in a terminal phase, by job: (namespace, job) -> {pod: status}
        # (terminal_status): how ranks ended whose agents could not say it (the arbiter
        # was away), handed to the registry every tick until the job is over (_exits_due)
        self._exits: dict[tuple[str, str], dict[str, int]] = {}
        self.node_names: set[str] = set()
        self.node_cache: dict[str, Any] = {}  # the watch's nodes (one entry per node)
        self._context: OrderedDict[str, tuple[ClusterFault, tuple[tuple[str, str, str], ...]]] \
            = OrderedDict()
        self._replacing: dict[tuple[str, str], float] = {}
        self._pending_seen: set[str] = set()
        self._terminating: dict[tuple[str, str], float] = {}
        self._force_deleted: set[str] = set()
        self._owners: dict[str, ObjectRef | None] = {}
        # job membership (membership.py): roots of the pods' controller chains
        self.job_owners = JobOwners()
        self.chains = OwnerChains(api_client)
        # what each pod's own object says (PodFacts less membership), computed once per
        # object the watch handed over (a Hello asks it twice; 10,000 ask at a failover)
        self._pod_derived: dict[tuple[str, str], tuple[Any, _Derived | None]] = {}
        # (pod object, node object, their Features) per pod: _set_tiers
        self._tier_parts: dict[tuple[str, str], tuple[Any, Any, Features]] = {}
        self._chain_pending: dict[tuple[str, str], set[str]] = {}  # (ns, job) -> uids
        self._chain_waiting: dict[str, tuple[str, Ref, set[tuple[str, str]]]] = {}
        self._annotations: dict[tuple[str, str], dict[str, str]] = {}
        self._annotating = False
        self._annotate_at: float | None = None  # when the noted annotations are written
        self._quiet_at = 0.0  # (monotonic) ANNOTATE_AFTER past the last decision
        self._annotate_jobs: dict[tuple[str, str], JobState] = {}  # jobs noted meanwhile
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._actions = ThreadPoolExecutor(2, thread_name_prefix="ftagent-kube-act")
        self._background = ThreadPoolExecutor(2, thread_name_prefix="ftagent-kube-bg")
        self._flushing = False
        self.trainjobs = TrainJobStatus(api_client, settings.trainjob_status_interval)
        self._trainjobs_at = -1e18  # the last pass over the jobs for TrainJob progress
        self.ticker: asyncio.Task[None] | None = None  # tick_forever, when started for it
        registry.add_decision_listener(self.on_decision)
        registry.pod_alive = self.pod_alive

    # ------------------------------------------------------------------ verified pods

    def pod_facts(self, namespace: str, name: str) -> PodFacts | None:
        """The pod as the watch sees it (job, rank, node, uid), for the server to check a
        pod credential's Hello against; None when the watch has not seen it (or it is
        gone, or its job's controller chains are still being read: retry). The job label
        ``ftagent.io/job`` names the job; membership comes from the pod's controller chain
        (kube/membership.py: a pod whose chain does not lead to the job's owner is no
        member); the rank from its labels (kube/identity.py), the world size from the
        owner's spec where it has one: never from anything the agent says."""
        key = (namespace, name)
        pod = self.pod_cache.get(key)
        if not isinstance(pod, dict):
            return None
        cached = self._pod_derived.get(key)
        d: _Derived | None
        if cached is not None and cached[0] is pod:
            d = cached[1]
        else:  # a new object from the watch (each event hands over a fresh dict)
            d = _derive(pod)
            self._pod_derived[key] = (pod, d)
        if d is None:
            return None
        self._chains_resolved()
        if self._chain_pending.get((namespace, d.job)):
            return None  # the owners of the job's pods are being read
        ref = d.ref
        root = None
        if ref is not None and (ref.group, ref.kind) in KIND_RANK:
            done, root = self.chains.known(ref.uid)
            if not done:
                self._index_owner(namespace, pod)
                return None
        member, why = self.job_owners.member(namespace, d.job, root)
        owner = self.job_owners.owner(namespace, d.job)
        world = owner.world if owner is not None and owner.world else d.world_size
        return PodFacts(uid=d.uid, job=d.job if member else "", node=d.node, rank=d.rank,
                        world_size=world, local_world=d.local_world, not_member=why)

    def _index_owner(self, namespace: str, pod: Any) -> None:
        """A labelled pod seen: its controller chain into the job owners' index (read in
        the background when not known yet)."""
        job = get(pod, "metadata", "labels", JOB_LABEL)
        ref = controller_ref(pod)
        if not isinstance(job, str) or ref is None or (ref.group, ref.kind) not in KIND_RANK:
            return
        done, root = self.chains.known(ref.uid)
        if done:
            if root is not None:
                self.job_owners.see(namespace, job, root)
            return
        if len(self._chain_waiting) >= CONTEXT_KEPT and ref.uid not in self._chain_waiting:
            return
        self._chain_pending.setdefault((namespace, job), set()).add(ref.uid)
        self._chain_waiting.setdefault(ref.uid, (namespace, ref, set()))[2].add(
            (namespace, job))
        self.chains.ask(namespace, ref)

    def _chains_resolved(self) -> None:
        """On the loop: chains the reader resolved join the index."""
        for uid, root in self.chains.take():
            got = self._chain_waiting.pop(uid, None)
            for key in got[2] if got is not None else ():
                pending = self._chain_pending.get(key)
                if pending is not None:
                    pending.discard(uid)
                    if not pending:
                        del self._chain_pending[key]
                if root is not None:
                    self.job_owners.see(key[0], key[1], root)

    def pod_alive(self, namespace: str, name: str, uid: str) -> bool:
        """Is pod ``namespace/name`` with ``uid`` still in the watch (a rank it registered
        stays its own until it is gone)?"""
        return self._uid(namespace, name) == uid

    def rebind(self, registry: Registry) -> None:
        """A new registry (a term as leader began or ended): faults go to it, its
        decisions are acted on. What the watches saw (pods, nodes) is kept."""
        self.registry = registry
        self._replacing.clear()
        self._annotate_jobs.clear()  # the earlier term's jobs: their states are not news
        self._blips.clear()
        registry.add_decision_listener(self.on_decision)
        registry.pod_alive = self.pod_alive
        if self.active():  # a term as leader: what the nodes are now, judged afresh
            self.nodes = NodeFaults(self.settings.node_notready_grace)
            for node in list(self.node_cache.values()):
                self.on_node("MODIFIED", node)

    def close(self, wait: bool = True) -> None:
        """Stop the workers (calls under way finish, queued ones are dropped)."""
        self._closing.set()
        self.chains.close()
        self._actions.shutdown(wait=wait, cancel_futures=True)
        self._background.shutdown(wait=wait, cancel_futures=True)

    # ------------------------------------------------------------------ events in

    def on_node(self, type_: str, node: Any) -> None:
        """A node watch event (ADDED / MODIFIED / DELETED), on the loop."""
        name = get(node, "metadata", "name")
        if not isinstance(name, str):
            return
        deleted = type_ == "DELETED"
        (self.node_names.discard if deleted else self.node_names.add)(name)
        if deleted:
            self.node_cache.pop(name, None)
            self.breaker.observe(name, None, float("inf"))
        elif isinstance(node, dict):
            self.node_cache[name] = node
            # the breaker's memory across leaders: the nodes held cordoned now
            self.breaker.observe(name, held_cordon(node, self.clock()), self.clock())
        if not self.active():  # a standby only keeps its caches (replayed when it leads)
            return
        # a node nobody runs on is watched for its Ready condition all the same (cheap),
        # but a deleted node matters only when ranks ran there
        if deleted and not self.registry.ranks_on_node(name):
            self.nodes.observe(node, self.clock(), deleted=False)
            return
        for cf in self.nodes.observe(node, self.clock(), deleted=deleted):
            self._report_node(cf)
        if not deleted:
            self._planned(name, node)

    def _planned(self, name: str, node: Any) -> None:
        """Lifecycle conditions True on ``node`` (node_lifecycle.py): a planned event on
        the timeline of each job with ranks there, once per transition; not a fault."""
        for p in planned(node):
            key = f"{name}:{p.type}:{p.since}"
            if key in self._planned_seen:
                continue
            self._planned_seen[key] = None
            while len(self._planned_seen) > CONTEXT_KEPT:
                self._planned_seen.popitem(last=False)
            now = self.clock()
            there: dict[tuple[str, str], tuple[JobState, list[int]]] = {}
            for job, rs in self.registry.ranks_on_node(name):
                if job.finished:
                    continue
                self.registry.record(
                    job, "note",
                    f"planned: node {name} {p.type}" + (f" ({p.reason}: {p.message})"
                                                        if p.reason or p.message else "")
                    + ": not a fault; ftagent does not cordon a node another system "
                    "drains", now, rank=rs.rank)
                there.setdefault((job.namespace, job.job), (job, []))[1].append(rs.rank)
            for job, ranks in there.values():  # last words before the disruption comes
                key = f"{job.namespace}/{job.job}@{name}"
                if now - self._last_words_at.get(key, -1e18) < LAST_WORDS_EVERY:
                    continue  # a condition flapping: once a minute per job and node
                self._last_words_at[key] = now
                while len(self._last_words_at) > CONTEXT_KEPT:
                    self._last_words_at.popitem(last=False)
                self.registry.execute(job, [Decision(
                    Verdict.LAST_WORDS, f"last words: node {name} {p.type}: ranks "
                    f"{', '.join(map(str, sorted(ranks)[:8]))} persist their newest complete "
                    "snapshot now (last words, where snapshots are on)", job.generation,
                    targets=tuple(sorted(ranks)))], now)

    def on_pod(self, type_: str, pod: Any) -> None:
        """A pod watch event, on the loop."""
        ns, name = get(pod, "metadata", "namespace"), get(pod, "metadata", "name")
        if not isinstance(ns, str) or not isinstance(name, str):
            return
        deleted = type_ == "DELETED"
        key = (ns, name)
        if deleted:
            self.pod_cache.pop(key, None)
            self._pod_derived.pop(key, None)
            self._tier_parts.pop(key, None)
            self._terminating.pop(key, None)
            job_name = get(pod, "metadata", "labels", JOB_LABEL)
            if isinstance(job_name, str) and (ns, job_name) in self._exits:
                self._exits[(ns, job_name)].pop(name, None)
            uid = get(pod, "metadata", "uid")
            self.on_pod_deleted(ns, name, uid if isinstance(uid, str) else "")
        elif isinstance(pod, dict):
            self.pod_cache[key] = pod
            self._pod_derived.pop(key, None)  # (keyed by the object too: never stale)
            self._tier_parts.pop(key, None)
            self._index_owner(ns, pod)
            self._terminal(ns, name, pod)
            gone_at = parse_time(get(pod, "metadata", "deletionTimestamp"))
            if gone_at is not None:  # Terminating since the delete: its deadline less grace
                grace = get(pod, "metadata", "deletionGracePeriodSeconds")
                if isinstance(grace, int) and 0 <= grace <= 10**6:
                    gone_at -= grace
                self._terminating.setdefault(key, gone_at)
        if not self.active():
            return
        found = self.registry.rank_of_pod(ns, name)
        if found is None:
            return
        job, rs = found
        if job.finished or rs.state in _QUIET_STATES:
            return
        for cf in self.pods.observe(pod, deleted=deleted):
            self._remember(cf, ((ns, name, cf.uid),))
            self.registry.report_fault(job.namespace, job.job, cf.fault, self.clock(),
                                       rank=rs.rank)
        if not deleted:
            self._device_health(job, rs, pod)
            self._dra_taints(job, rs, pod)
            self._set_tiers(job, rs)

    def _terminal(self, ns: str, name: str, pod: dict[str, Any]) -> None:
        """A labelled pod in a terminal phase: its trainer's exit kept for the tick."""
        job = get(pod, "metadata", "labels", JOB_LABEL)
        if not isinstance(job, str) or not job:
            return
        if get(pod, "status", "phase") not in ("Succeeded", "Failed"):
            return  # running or pending (terminal_status: None), every pod of a list
        found = identify(pod, {})
        index, _ = trainer_index(pod, found.role if found else "")
        containers = get(pod, "spec", "containers")
        trainer = get(containers[index], "name") if index is not None and \
            isinstance(containers, list) else ""
        status = terminal_status(pod, trainer if isinstance(trainer, str) else "")
        if status is None:
            return
        if (ns, job) not in self._exits and len(self._exits) >= CONTEXT_KEPT:
            return
        self._exits.setdefault((ns, job), {})[name] = status

    def _exits_due(self, now: float) -> None:
        """Terminal pods' exits to the registry, per job, as ranks (the pod's rank as the
        watch sees it, members of the job only: pod_facts); a job over, or one the
        registry does not know, is dropped."""
        for key, pods in list(self._exits.items()):
            exits: dict[int, int] = {}
            for name, status in pods.items():
                facts = self.pod_facts(key[0], name)
                if facts is not None and facts.job == key[1] and facts.rank is not None:
                    # a rank's pod that succeeded beats an earlier one that failed (a
                    # pod replaced, then its successor finished)
                    exits[facts.rank] = min(status, exits.get(facts.rank, status))
            if not exits:
                continue  # membership still being read, or none is a member: next tick
            if self.registry.exits_seen(key[0], key[1], exits, "its pods' terminal "
                                        "status", now):
                del self._exits[key]

    def _device_health(self, job: JobState, rs: Any, pod: Any) -> None:
        """The kubelet's device health in the pod's status (device_health.py): an
        Unhealthy device the pod holds replaces that rank's pod, as node-scope evidence.
        Only for the job's own pod as the watch sees it (its namespace, its job label, the
        uid its rank registered from): a status of another job's pod acts on nothing here."""
        ns, name = get(pod, "metadata", "namespace"), get(pod, "metadata", "name")
        uid = get(pod, "metadata", "uid")
        if ns != job.namespace or get(pod, "metadata", "labels", JOB_LABEL) != job.job or \
                (rs.pod_uid and rs.pod_uid != uid):
            return
        faults, ignored = self.devices.observe(pod)
        now = self.clock()
        for why in ignored:
            msg = f"device health of pod {name} ignored: {why}"
            log.warning("job %s/%s: %s", job.namespace, job.job, msg)
            self.registry.record(job, "note", msg, now, rank=rs.rank)
        for cf in faults:
            self._remember(cf, ((ns, name, cf.uid),))
            self.registry.report_fault(job.namespace, job.job, cf.fault, now, rank=rs.rank)

    # ------------------------------------------------------------ DRA (kube/dra.py)

    def on_resource_slice(self, type_: str, sl: Any) -> None:
        """A ResourceSlice watch event, on the loop: a device newly tainted by its driver
        is looked for among the running jobs' pods."""
        if self.dra.on_slice(type_, sl) and self.active():
            self._dra_all()

    def on_resource_claim(self, type_: str, claim: Any) -> None:
        """A ResourceClaim watch event, on the loop (its allocation, whom it serves)."""
        uids = self.dra.on_claim(type_, claim)
        if uids and self.active():
            self._dra_all(uids)

    def on_device_taint_rule(self, type_: str, obj: Any) -> None:
        """ftagent's own DeviceTaintRules as the watch sees them: the breaker holds each
        tainted device until its rule is deleted (a new leader counts its predecessor's)."""
        sel = get(obj, "spec", "deviceSelector")
        dev = tuple(get(sel, k) for k in ("driver", "pool", "device"))
        if not all(isinstance(x, str) and x for x in dev) or \
                name_of(obj) != rule_name(*dev):
            return
        now = self.clock()
        job = get(obj, "metadata", "annotations", "ftagent.io/fault-job")
        held = None if type_ == "DELETED" or get(obj, "spec", "taint", "effect") == "None" \
            else Held(job if isinstance(job, str) else "", now, True)
        self.breaker.observe(device_key(*dev), held, now)

    def _dra_all(self, uids: frozenset[str] | None = None) -> None:
        """The running jobs' pods (only those of ``uids`` when given) against the taints."""
        for job in list(self.registry.jobs.values()):
            if job.finished:
                continue
            for rs in list(job.ranks.values()):
                pod = self.pod_cache.get((job.namespace, rs.pod)) if rs.pod else None
                if pod is None or rs.state in _QUIET_STATES or (
                        uids is not None and get(pod, "metadata", "uid") not in uids):
                    continue
                self._dra_taints(job, rs, pod)

    def _dra_taints(self, job: JobState, rs: Any, pod: Any) -> None:
        """A DRA device the pod holds tainted by its driver (dra.py): that rank's pod is
        replaced and the device tainted, as node-scope evidence; only for the job's own
        pod as the watch sees it (as ``_device_health``)."""
        ns, name = get(pod, "metadata", "namespace"), get(pod, "metadata", "name")
        if ns != job.namespace or get(pod, "metadata", "labels", JOB_LABEL) != job.job or \
                (rs.pod_uid and rs.pod_uid != get(pod, "metadata", "uid")):
            return
        for cf in self.dra.observe(pod):
            self._remember(cf, ((ns, name, cf.uid),))
            self.registry.report_fault(job.namespace, job.job, cf.fault, self.clock(),
                                       rank=rs.rank)

    def _report_node(self, cf: ClusterFault, only: tuple[str, str] | None = None) -> None:
        by_job: dict[tuple[str, str], list[Any]] = {}
        for job, rs in self.registry.ranks_on_node(cf.node):
            if not job.finished and only in (None, (job.namespace, job.job)):
                by_job.setdefault((job.namespace, job.job), []).append(rs)
        for (ns, name), ranks in list(by_job.items()):
            if only is None and self._blip(cf, ns, name, ranks):
                del by_job[(ns, name)]
        for (ns, name), ranks in by_job.items():
            pods = tuple((ns, r.pod, self._uid(ns, r.pod)) for r in ranks if r.pod)
            ev = {**cf.fault.evidence, "ranks": [r.rank for r in ranks][:64],
                  "pods": [p[1] for p in pods][:64]}
            fault = dataclasses.replace(cf.fault, evidence=ev)
            self._remember(cf, pods)
            self.registry.report_fault(ns, name, fault, self.clock(), rank=ranks[0].rank)

    def _blip(self, cf: ClusterFault, ns: str, name: str, ranks: list[Any]) -> bool:
        """A NotReady node whose ranks of this job all keep stepping (node_blip.py): the
        fault is held back (``_blips``, re-checked every tick) and the timeline says so."""
        since = cf.fault.evidence.get("since")
        if "ready" not in cf.fault.evidence or not isinstance(since, float | int):
            return False  # a deleted node is never a blip
        now = self.clock()
        got = still_stepping(ranks, float(since), now, self._step_window())
        if not got.stepping:
            log.info("node %s not Ready: job %s/%s acted on (%s)", cf.node, ns, name, got.why)
            return False
        if (cf.node, (ns, name)) not in self._blips and len(self._blips) < CONTEXT_KEPT:
            self._blips[(cf.node, (ns, name))] = cf
            job = self.registry.jobs.get((ns, name))
            if job is not None:
                self.registry.record(
                    job, "note",
                    f"node {cf.node} not Ready for {now - since:.0f}s but {got.why}: a "
                    "blip, no replacement (acted on if they stop while it stays NotReady)",
                    now, rank=ranks[0].rank, fault_id=cf.fault.id)
        return True

    def _step_window(self) -> float:
        return max(self.settings.node_notready_grace, self.step_window)

    def _blips_due(self, now: float) -> None:
        """Held-back NotReady faults: dropped once the node is Ready again, reported to
        the job once its ranks there stop stepping while it is still NotReady."""
        for (node, key), cf in list(self._blips.items()):
            job = self.registry.jobs.get(key)
            since = self.nodes.down(node, cf.fault.id)
            if job is None or job.finished or since is None:
                del self._blips[(node, key)]
                if job is not None and not job.finished and node in self.node_names:
                    self.registry.record(
                        job, "note",
                        f"node {node} Ready again (or a new transition): the NotReady blip "
                        "passed with nothing replaced", now, fault_id=cf.fault.id)
                continue
            ranks = [rs for j, rs in self.registry.ranks_on_node(node) if j is job]
            if not still_stepping(ranks, since, now, self._step_window()).stepping:
                del self._blips[(node, key)]
                self._report_node(cf, only=key)

    def _remember(self, cf: ClusterFault, pods: tuple[tuple[str, str, str], ...]) -> None:
        self._context[cf.fault.id] = (cf, pods)
        while len(self._context) > CONTEXT_KEPT:
            self._context.popitem(last=False)

    def _uid(self, ns: str, pod: str) -> str:
        uid = get(self.pod_cache.get((ns, pod)), "metadata", "uid")
        return uid if isinstance(uid, str) else ""

    # ------------------------------------------------------------------ deadlines

    def tick(self) -> None:
        """On the loop, every half second: nodes past their grace, replacements stuck
        Pending, pods stuck Terminating, Events waiting for the rate limit."""
        now = self.clock()
        self._chains_resolved()
        for ns, ref, _ in list(self._chain_waiting.values()):
            self.chains.ask(ns, ref)  # one that failed (5xx, transport): again
        for cf in self.nodes.due(now):
            self._report_node(cf)
        self._blips_due(now)
        for (ns, name), since in list(self._replacing.items()):
            job = self.registry.jobs.get((ns, name))
            if job is None or job.finished or job.barrier is None or job.barrier.released:
                del self._replacing[(ns, name)]
                continue
            unscheduled = False
            for (pns, _), pod in self.pod_cache.items():
                if pns != ns or get(pod, "metadata", "labels", JOB_LABEL) != name:
                    continue
                unscheduled = unscheduled or waits_for_a_node(pod)
                stuck = pending_fault(pod, now, since, self.settings.pending_grace,
                                      self._pending_seen)
                if stuck is not None:
                    self.registry.report_fault(ns, name, stuck.fault, now)
            # the goodput ledger: time a replacement waits for a node is capacity
            self.registry.waiting_for_capacity(ns, name, unscheduled, now)
        after = self.settings.force_delete_after
        if after >= 0:
            for key, gone_at in list(self._terminating.items()):
                uid = self._uid(*key)
                if now - gone_at >= after and uid not in self._force_deleted:
                    self._force_deleted.add(uid)
                    self._submit(self._actions, self._force_delete, key[0], key[1], uid,
                                 now - gone_at)
        if not self._flushing and self.recorder.dirty():
            self._flush_events()
        self._exits_due(now)
        self._trainjob_progress(now)
        self._uncordon_due(now)
        self._taint_fallbacks_due(now)
        self._annotations_due(now)

    def _trainjob_progress(self, now: float) -> None:
        """Each training job whose pods belong to a Kubeflow TrainJob: its step, loss,
        goodput and restarts in the TrainJob's status.trainerStatus (trainjob_status.py),
        at most every --interval per job, written in the background. A pass over the
        jobs at most every 5 s; nothing once the writer found nowhere to write."""
        tj = self.trainjobs
        if tj.off or tj.interval <= 0 or now - self._trainjobs_at < min(tj.interval, 5.0):
            return
        self._trainjobs_at = now
        for job in list(self.registry.jobs.values()):
            if job.finished:
                continue
            pod = next((self.pod_cache[(job.namespace, r.pod)] for r in job.ranks.values()
                        if (job.namespace, r.pod) in self.pod_cache), None)
            owner = self._owner(pod) if pod is not None else None
            if owner is None or (owner.group, owner.kind) != ("trainer.kubeflow.org",
                                                              "TrainJob"):
                continue
            if not tj.due(owner.namespace, owner.name, now):
                continue
            info = self.registry.job_info(job, ranks=False)
            steps = [r.step for r in job.ranks.values() if r.step >= 0]
            loss = next((r.loss for r in sorted(job.ranks.values(), key=lambda r: r.rank)
                         if r.loss is not None), None)
            status = trainer_status(max(steps) if steps else None, loss,
                                    info.goodput.ratio if info.HasField("goodput") else None,
                                    job.restarts, now)
            self._submit(self._background, tj.write, owner.namespace, owner.name, status)

    # ------------------------------------------------------------------ decisions out

    def on_decision(self, job: JobState, d: Decision, now: float) -> None:
        """The registry's decision listener (on the loop, commands already queued)."""
        # the annotations wait while decisions are being made: their agents come first
        self._quiet_at = time.monotonic() + ANNOTATE_AFTER
        self._events_for(job, d, now)
        if d.verdict is Verdict.REPLACE and d.rank is not None and not in_place(d):
            self._replace(job, d, now)  # (an in-place tier keeps the pod and its node)
        if d.verdict in (Verdict.RESTART, Verdict.REPLACE) or (
                d.verdict is Verdict.RELEASE_BARRIER and not d.targets):
            self._ladder(job, d)
        if d.verdict in (Verdict.RESTART, Verdict.REPLACE, Verdict.STOP) or (
                d.verdict is Verdict.RELEASE_BARRIER and not d.targets):
            self._annotate(job)

    def _ladder(self, job: JobState, d: Decision) -> None:
        """The recovery ladder's view of the job's ranks (ladder.Features on each): the
        restart streak this decision extends or ends, then what each rank's pod and node
        have, read again (a new generation: pods may have moved)."""
        if d.verdict is not Verdict.RELEASE_BARRIER:
            self.streaks.note((job.namespace, job.job), d.rank, d.generation,
                              restart=d.verdict is Verdict.RESTART or in_place(d))
        for rs in list(job.ranks.values()):
            self._set_tiers(job, rs)

    def _set_tiers(self, job: JobState, rs: Any) -> None:
        """The rank's ladder Features. Run for every rank at each RESTART and release,
        on the loop before the commands are written: what the pod and node objects say
        (their restart rules, the kubelet's version and gates) is read once per pair of
        objects the watches handed over; spare and streak are the job's now."""
        key = (job.namespace, rs.pod)
        pod = self.pod_cache.get(key) if rs.pod else None
        node_name = get(pod, "spec", "nodeName")
        node = self.node_cache.get(node_name) if isinstance(node_name, str) else None
        cached = self._tier_parts.get(key) if pod is not None else None
        if cached is not None and cached[0] is pod and cached[1] is node:
            parts = cached[2]
        else:
            parts = features_of(pod, node)
            if pod is not None:
                self._tier_parts[key] = (pod, node, parts)
        rs.tiers = Features(parts.version, parts.declared, parts.rules, spare=bool(job.spares),
                            repeats=self.streaks.repeats((job.namespace, job.job), rs.rank,
                                                         job.generation))

    def _replace(self, job: JobState, d: Decision, now: float) -> None:
        rs = job.ranks.get(d.rank) if d.rank is not None else None
        got = self._context.get(d.fault_id)
        cf: ClusterFault | None = got[0] if got is not None else None
        pods = got[1] if got is not None else ()
        if not pods and rs is not None and rs.pod:
            pods = ((job.namespace, rs.pod, self._uid(job.namespace, rs.pod)),)
        pods = self._verified_pods(job, rs, pods, now)
        kind = self.registry.fault_kind(job, d.fault_id) or "node"
        who = f"{job.namespace}/{job.job}" if job.namespace else job.job
        # the node is where the watch says the pod runs, never what a Hello said
        node = cf.node if cf is not None and cf.node else next(
            (n for ns, name, _ in pods if (n := self._node_of(ns, name))), "")
        evidence = "corroborated"
        if cf is not None:  # the API server's own view: its scope decides
            cordon, why = bool(node) and cf.fault.scope is Scope.NODE, ""
            evidence = "device-health" if cf.fault.evidence.get("device_health") is True \
                else "dra-taint" if cf.fault.evidence.get("dra_taint") is True \
                else "node-condition"
        elif node:
            account = next((a for ns, name, _ in pods
                            if (a := self._account_of(ns, name))), "")
            cordon, why = self.evidence.verdict(node, who, kind, d.fault_id, now,
                                                job.namespace, account)
            if self.evidence.from_node_agent(d.fault_id, node) or \
                    self.evidence.agent_confirms(node, kind, now):
                evidence = "node-agent"
        else:
            cordon, why = False, ""
        if node and not cordon and why:
            msg = f"node {node} not cordoned: {why}"
            self.registry.record(job, "decision", msg, now, rank=d.rank, fault_id=d.fault_id)
            self._event(job, pods[0][1] if pods else "", "Normal", "NodeNotCordoned", msg,
                        now)
        dra = cf.fault.evidence.get("dra") if cf is not None else None
        if cordon and dra and isinstance(dra, list):
            # DRA devices: taint each one (KEP-5055), not the node; the node's cordon
            # only if the cluster cannot take the taint (_taint_fallbacks_due)
            cordon = False
            devs = [tuple(str(y) for y in x) for x in dra[:16]
                    if isinstance(x, list) and len(x) == 3]
            devs = [x for x in devs if self._breaker_allows(
                job, rs, device_key(*x), who, d, now, evidence)]  # as a node costs
            if devs:
                self._submit(self._actions, self._taint_devices, job, node, kind, d.reason,
                             d.fault_id, who, devs, d.rank, now)
        other = held_by_other(self.node_cache.get(node)) if cordon else ""
        if other:  # another system drains it: the pod moves, the node stays theirs
            cordon = False
            msg = f"node {node} not cordoned: {other}"
            self.registry.record(job, "decision", msg, now, rank=d.rank, fault_id=d.fault_id)
        if cordon:
            cordon = self._breaker_allows(job, rs, node, who, d, now, evidence)
        for _, _, uid in pods:
            self.pods.deleted_by_us(uid)
        self._replacing[(job.namespace, job.job)] = now
        self._submit(self._actions, self._carry_out_replace, job, node if cordon else "",
                     kind, d.reason, d.fault_id, who, pods, now, evidence)

    def _breaker_allows(self, job: JobState, rs: Any, node: str, who: str, d: Decision,
                        now: float, evidence: str = "corroborated") -> bool:
        job_nodes = len(self._job_nodes(job))
        confirmed = evidence != "corroborated"
        v = self.breaker.check(node, who, job_nodes, len(self.node_names), now, confirmed)
        if v.allowed:
            self.breaker.record(node, who, now, confirmed)
            self.health.forget(node)  # healthy from now on counts afresh
            return True
        msg = f"{node} not tainted: {v.reason}" if node.startswith("device ") else \
            f"node {node} not cordoned: {v.reason}"
        log.warning("%s (job %s)", msg, who)
        self.on_cordon_skipped()
        self.registry.record(job, "decision", msg, now, rank=d.rank, fault_id=d.fault_id)
        self._event(job, rs.pod if rs else "", "Warning", "CordonSkipped", msg, now)
        return False

    def _job_nodes(self, job: JobState) -> set[str]:
        """The nodes the job's pods run on, as the watch sees them (what the breaker counts:
        never the nodes its agents name)."""
        return {n for (ns, _), pod in self.pod_cache.items()
                if ns == job.namespace and get(pod, "metadata", "labels", JOB_LABEL) == job.job
                and isinstance(n := get(pod, "spec", "nodeName"), str) and n}

    def _account_of(self, namespace: str, pod: str) -> str:
        """The pod's ServiceAccount as the watch sees it (``default`` when unset)."""
        p = self.pod_cache.get((namespace, pod))
        if p is None:
            return ""
        sa = get(p, "spec", "serviceAccountName")
        return sa if isinstance(sa, str) and sa else "default"

    def _node_of(self, namespace: str, pod: str) -> str:
        node = get(self.pod_cache.get((namespace, pod)), "spec", "nodeName")
        return node if isinstance(node, str) else ""

    def _verified_pods(self, job: JobState, rs: Any, pods: tuple[tuple[str, str, str], ...],
                       now: float) -> tuple[tuple[str, str, str], ...]:
        """Only pods the watch sees in the job's namespace, labelled for the job, with the
        uid the rank registered from (when a pod credential registered it): a Hello that
        named another pod (another job's, kube-system's) deletes nothing."""
        out = []
        for ns, name, uid in pods:
            pod = self.pod_cache.get((ns, name))
            live = get(pod, "metadata", "uid")
            why = ""
            if ns != job.namespace or pod is None:
                why = "not in the job's namespace as the watch sees it"
            elif get(pod, "metadata", "labels", JOB_LABEL) != job.job:
                why = f"not labelled {JOB_LABEL}={job.job}"
            elif not isinstance(live, str) or not live or (uid and uid != live):
                why = "replaced since (another uid)"
            elif rs is not None and rs.pod_uid and rs.pod == name and rs.pod_uid != live:
                why = "not the pod that registered the rank (another uid)"
            if why:
                log.warning("job %s/%s: pod %s/%s not deleted: %s", job.namespace, job.job,
                            ns, name, why)
                continue
            out.append((ns, name, live))
        return tuple(out)

    def node_reported(self, node: str, fault_ids: list[str], kinds: set[str]) -> None:
        """A node agent's report for ``node`` was accepted (the server's ReportNode hook,
        on the loop, before it decides them): node-scope evidence for it. Pod faults of
        those kinds that replaced a pod there without a cordon get the cordon now."""
        if not self.active():
            return
        now = self.clock()
        self.evidence.node_agent(node, kinds, fault_ids, now)
        for p in self.evidence.confirmations(node, kinds, now):
            ns, _, name = p.job.partition("/")
            job = self.registry.jobs.get((ns, name) if name else ("", ns))
            if job is None:
                continue
            d = Decision(Verdict.REPLACE, reason=f"node {node}'s agent confirmed the {p.kind} "
                         "fault", generation=job.generation, fault_id=p.fault_id)
            if self._breaker_allows(job, None, node, p.job, d, now, "node-agent"):
                self._submit(self._actions, self._carry_out_replace, job, node, p.kind,
                             d.reason, p.fault_id, p.job, (), now, "node-agent")

    def node_health(self, node: str, healthy: bool) -> None:
        """A verified node agent's report for ``node`` said whether the node is healthy
        (the server's hook, on the loop): with --uncordon-after, ftagent's own cordon of
        a node healthy that long is undone (``tick``)."""
        if self.active():
            self.health.report(node, healthy, self.clock())

    def _uncordon_due(self, now: float) -> None:
        with self._lock:
            done, self._uncordoned = self._uncordoned, []
        for node in done:
            self._uncordoning.discard(node)
            self.breaker.release(node)
            self.health.forget(node)
        for node in self.health.due(self.breaker.cordoned(), now):
            if node in self._uncordoning:
                continue
            self._uncordoning.add(node)
            self._submit(self._actions, self._uncordon, node,
                         f"its node agent reported it healthy for "
                         f"{self.settings.uncordon_after:.0f}s (--uncordon-after)")

    def _uncordon(self, node: str, why: str) -> None:
        """In a worker: undo ftagent's cordon of ``node``."""
        try:
            if self.actuator.uncordon(node, why):
                self.on_uncordon(node)
        except (Forbidden, GaveUp):
            self.on_action_failed("uncordon")
        finally:
            with self._lock:  # the loop's next tick forgets it (breaker, health)
                self._uncordoned.append(node)

    def _carry_out_replace(self, job: JobState, node: str, kind: str, reason: str,
                           fault_id: str, who: str, pods: tuple[tuple[str, str, str], ...],
                           now: float, evidence: str = "corroborated") -> None:
        """In a worker: cordon first (so the new pod lands elsewhere), then delete."""
        if node:
            try:
                if self.actuator.cordon(node, kind, reason, fault_id, who, now, evidence):
                    self.on_cordon(node, kind)
                    self._event(job, pods[0][1] if pods else "", "Warning", "NodeCordoned",
                                f"node {node} cordoned and tainted ftagent.io/fault={kind}:"
                                f"NoSchedule: {reason}", now)
            except (Forbidden, GaveUp):
                self.on_action_failed("cordon")
            except Exception:
                self.on_action_failed("cordon")
                log.exception("cordoning node %s failed", node)
        for ns, name, uid in pods:
            try:
                if self.actuator.delete_pod(ns, name, uid):
                    self._event(job, name, "Warning", "PodDeleted", f"pod {name} deleted so "
                                "that its controller replaces it: " + reason, now)
            except (Forbidden, GaveUp):
                self.on_action_failed("delete_pod")
            except Exception:
                self.on_action_failed("delete_pod")
                log.exception("deleting pod %s/%s failed", ns, name)

    def _taint_devices(self, job: JobState, node: str, kind: str, reason: str,
                       fault_id: str, who: str, devices: list[tuple[str, ...]], rank: Any,
                       now: float) -> None:
        """In a worker: a DeviceTaintRule per faulty DRA device; where the cluster has
        none (or forbids it), the node's cordon instead, decided on the loop."""
        for i, dev in enumerate(devices):
            if len(dev) != 3:
                continue
            driver, pool, device = (str(x) for x in dev)
            try:
                if taint_device(self.api_client, driver, pool, device, reason, fault_id,
                                who):
                    self._event(job, "", "Warning", "DeviceTainted",
                                f"device {driver}/{pool}/{device} tainted "
                                f"{TAINT_KEY}=device:None (dry run), then NoSchedule "
                                f"(node {node} stays schedulable): {reason}", now)
            except Absent as e:
                log.warning("job %s: %s; cordoning node %s instead", who, e, node)
                with self._lock:  # this device and the ones after it: never written
                    self._taint_failed.extend(device_key(*(str(x) for x in d))
                                              for d in devices[i:] if len(d) == 3)
                    self._taint_fallbacks.append(((job.namespace, job.job), node, kind,
                                                  reason, fault_id, rank))
                return
            except Exception:
                self.on_action_failed("taint_device")
                log.exception("tainting device %s/%s/%s failed", driver, pool, device)
                with self._lock:  # never written: the breaker forgets it on the loop
                    self._taint_failed.append(device_key(driver, pool, device))

    def _taint_fallbacks_due(self, now: float) -> None:
        with self._lock:
            due, self._taint_fallbacks = self._taint_fallbacks, []
            failed, self._taint_failed = self._taint_failed, []
        for dev_key in failed:  # (the breaker is the loop's: released here, not in a worker)
            self.breaker.release(dev_key)
        for key, node, kind, reason, fault_id, rank in due:
            job = self.registry.jobs.get(key)
            if job is None or not node or held_by_other(self.node_cache.get(node)):
                continue
            who = f"{job.namespace}/{job.job}" if job.namespace else job.job
            d = Decision(Verdict.REPLACE, reason=reason, generation=job.generation,
                         fault_id=fault_id, rank=rank)
            if self._breaker_allows(job, None, node, who, d, now, "device-health"):
                self._submit(self._actions, self._carry_out_replace, job, node, kind,
                             reason, fault_id, who, (), now, "device-health")

    def _force_delete(self, ns: str, name: str, uid: str, stuck: float) -> None:
        try:
            if self.actuator.delete_pod(ns, name, uid, grace=0):
                log.warning("force-deleted pod %s/%s, Terminating for %.0fs (past "
                            "--force-delete-after)", ns, name, stuck)
        except (Forbidden, GaveUp):
            self.on_action_failed("force_delete")

    # ------------------------------------------------------------------ Events, annotations

    def _events_for(self, job: JobState, d: Decision, now: float) -> None:
        if d.verdict is Verdict.RELEASE_BARRIER and not d.targets and job.restarts:
            self._event(job, "", "Normal", "TrainingResumed", d.reason, now)
            return
        got = REASONS.get(d.verdict)
        if got is None:
            return
        if d.culprits:  # on each culprit's pod (the first few) and the job object
            pods = [c.pod for c in d.culprits[:CULPRIT_EVENT_PODS] if c.pod]
        else:
            rs = job.ranks.get(d.rank) if d.rank is not None else None
            pods = [rs.pod] if rs is not None and rs.pod else []
        notes = culprit_annotations(d) if d.verdict in CULPRIT_VERDICTS else None
        self._event(job, pods, got[0], got[1], d.reason, now, notes)

    def _event(self, job: JobState, pod: str | list[str], type_: str, reason: str,
               message: str, now: float,
               annotations: Mapping[str, str] | None = None) -> None:
        """An Event on each of ``pod`` (those known) and one on the job object (from the
        loop or a worker: the recorder is thread-safe; the pod cache is only read here)."""
        obj = None
        for name in [pod] if isinstance(pod, str) else pod:
            got = self.pod_cache.get((job.namespace, name)) if name else None
            if got is not None and (ref := pod_ref(got)) is not None:
                self.recorder.record(ref, reason, message, type_, now, annotations)
            obj = obj or got
        if obj is None:  # any pod of the job tells its owner
            obj = next((self.pod_cache[(job.namespace, r.pod)] for r in list(job.ranks.values())
                        if (job.namespace, r.pod) in self.pod_cache), None)
        owner = self._owner(obj) if obj is not None else None
        if owner is not None:
            self.recorder.record(owner, reason, message, type_, now, annotations)
        self._flush_events()

    def _owner(self, pod: dict[str, Any]) -> ObjectRef | None:
        uid = str(get(pod, "metadata", "uid") or "")
        if uid in self._owners:
            return self._owners[uid]
        # owners that need a read (batch Job -> JobSet -> TrainJob) are resolved in the
        # background; until then the pod's own controller (if a job kind) stands in
        ref = job_owner(pod, lambda _ref: None)
        self._owners[uid] = ref
        if len(self._owners) > CONTEXT_KEPT:
            self._owners.pop(next(iter(self._owners)))
        if ref is not None and (ref.group, ref.kind) in CLIMB:
            def climb() -> None:
                found = job_owner(pod, self._read_owner)
                with self._lock:
                    if uid in self._owners:
                        self._owners[uid] = found
            self._submit(self._background, climb)
        if ref is not None and (ref.group, ref.kind) not in JOB_KINDS:
            return None
        return ref

    def _read_owner(self, ref: ObjectRef) -> dict[str, Any] | None:
        """In a worker: a batch Job or a JobSet, to read its own controller (None when it
        cannot be read: RBAC, gone; the Event then stays on the object below)."""
        import json

        from kubernetes import client

        resp: Any
        try:
            if (ref.group, ref.kind) == ("batch", "Job"):
                resp = client.BatchV1Api(self.api_client).read_namespaced_job(
                    ref.name, ref.namespace, _preload_content=False, _request_timeout=10)
            else:
                group, _, version = ref.api_version.partition("/")
                resp = client.CustomObjectsApi(self.api_client).get_namespaced_custom_object(
                    group, version, ref.namespace, "jobsets", ref.name,
                    _preload_content=False, _request_timeout=10)
            raw = resp.data[:MAX_OWNER_BYTES + 1]
            if len(raw) > MAX_OWNER_BYTES:
                return None
            obj = json.loads(raw)
            return obj if isinstance(obj, dict) else None
        except Exception as e:  # best effort: the Event lands on the Job instead
            log.debug("cannot read %s %s/%s for its owner: %s", ref.kind, ref.namespace,
                      ref.name, e)
            return None

    def _flush_events(self) -> None:
        if self._flushing:
            return
        self._flushing = True

        def run() -> None:
            try:
                self.recorder.flush()
            finally:
                self._flushing = False

        self._submit(self._background, run)

    def _annotate(self, job: JobState) -> None:
        """Its ranks' pods are to be annotated with their state: by the tick's
        ``_annotations_due``, ANNOTATE_AFTER later, with the states then (latest wins)."""
        self._annotate_jobs[(job.namespace, job.job)] = job
        if self._annotate_at is None:
            self._annotate_at = self.clock() + ANNOTATE_AFTER

    def _annotations_due(self, now: float) -> None:
        """On the tick: the pods of the jobs noted at least ANNOTATE_AFTER ago get their
        ranks' states, written in the background. Not at the decision itself: a 1,000-rank
        job's 1,000 PATCHes (and the 1,000 watch events they cause) would compete with the
        commands and the barrier its agents wait for; and a restart's states are written
        once, as its release left them, not twice."""
        if self._annotate_at is None or now < self._annotate_at or self._annotating:
            return
        self._annotate_at = None
        jobs, self._annotate_jobs = self._annotate_jobs, {}
        notes: dict[tuple[str, str], dict[str, str]] = {}
        for job in jobs.values():
            for r in job.ranks.values():
                pod = self.pod_cache.get((job.namespace, r.pod)) if r.pod else None
                if pod is None:
                    continue
                want = {STATE_ANNOTATION: r.state or "unknown",
                        "ftagent.io/generation": str(job.generation)}
                has = get(pod, "metadata", "annotations")
                if not isinstance(has, dict) or any(has.get(k) != v for k, v in want.items()):
                    notes[(job.namespace, r.pod)] = want  # (the pod says so already: no PATCH)
        if not notes:
            return
        with self._lock:
            self._annotations.update(notes)
        self._annotating = True
        self._submit(self._background, self._drain_annotations)

    def _drain_annotations(self) -> None:
        """In a worker: one PATCH per noted pod, at most ANNOTATE_RATE a second (a
        background write never takes more of the arbiter, or of the API server, than
        that: 10,000 pods are 100 s of trickle, not a storm beside the agents), and none
        until ANNOTATE_AFTER past the last decision (a fault, its restart, its barrier:
        while agents wait for commands, the arbiter and the API server are theirs)."""
        gap = 1.0 / ANNOTATE_RATE
        due = time.monotonic()
        try:
            while True:
                with self._lock:
                    if not self._annotations:
                        return
                    key = next(iter(self._annotations))
                    notes = self._annotations.pop(key)
                wait = max(due, self._quiet_at) - time.monotonic()
                while wait > 0:  # paced, and paused until a second after the last decision
                    if self._closing.wait(wait):
                        return
                    wait = max(due, self._quiet_at) - time.monotonic()
                due = max(due, time.monotonic() - gap) + gap
                try:
                    self.actuator.annotate_pod(key[0], key[1], notes)
                except (Forbidden, GaveUp):
                    with self._lock:
                        self._annotations.clear()
                    return
                except Exception as e:
                    log.debug("annotating %s/%s: %s", key[0], key[1], e)
        finally:
            self._annotating = False

    def _submit(self, pool: ThreadPoolExecutor, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # shut down
            pool.submit(self._guarded, fn, *args)

    @staticmethod
    def _guarded(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("kube action %s failed", getattr(fn, "__name__", fn))


@dataclass(frozen=True, slots=True)
class _Derived:
    """What one pod object alone says for ``Cluster.pod_facts`` (its uid, job label, node,
    rank and world size from its labels and trainer's literal env, the ranks it runs, its
    controller): pure in the object, so kept per object; membership is asked each time."""

    uid: str
    job: str
    node: str
    rank: int | None
    world_size: int | None
    local_world: int
    ref: Ref | None


def _derive(pod: dict[str, Any]) -> _Derived | None:
    uid = get(pod, "metadata", "uid")
    job = get(pod, "metadata", "labels", JOB_LABEL)
    if not isinstance(uid, str) or not isinstance(job, str):
        return None
    found = identify(pod, {})
    index, _ = trainer_index(pod, found.role if found else "")
    containers = get(pod, "spec", "containers")
    trainer = containers[index] if index is not None and isinstance(containers, list) \
        else None
    if found is not None and isinstance(trainer, dict):
        found = identify(pod, literal_env(trainer))
    node = get(pod, "spec", "nodeName")
    return _Derived(uid, job, node if isinstance(node, str) else "",
                    found.rank if found else None, found.world_size if found else None,
                    local_world(pod, trainer if isinstance(trainer, dict) else None),
                    controller_ref(pod))


def held_cordon(node: Any, now: float) -> Held | None:
    """ftagent's cordon of ``node`` as the watch shows it (its annotation, and the node
    still unschedulable), or None: what the breaker counts."""
    notes = get(node, "metadata", "annotations")
    if not isinstance(notes, dict) or notes.get(ANNOTATIONS + "cordoned-by") \
            != "ftagent-arbiter" or get(node, "spec", "unschedulable") is not True:
        return None
    at = parse_time(notes.get(ANNOTATIONS + "cordoned-at"))
    evidence = notes.get(EVIDENCE_ANNOTATION)
    return Held(str(notes.get(ANNOTATIONS + "fault-job", ""))[:300],
                at if at is not None else now,
                evidence in ("node-agent", "node-condition", "device-health"))


async def tick_forever(cluster: Cluster, interval: float = 0.5) -> None:
    """The cluster's deadlines on the loop (the arbiter's ticker runs its own)."""
    while True:
        await asyncio.sleep(interval)
        try:
            if cluster.active():
                cluster.tick()
        except Exception:
            log.exception("cluster tick failed")


# --------------------------------------------------------------------------- watches


class _Watch:
    """An informer as the callers of ``start_watches`` hold it: ``join`` after ``stop``
    is set stops it (the read in progress is cut) and waits for its thread."""

    def __init__(self, informer: Any) -> None:
        self.informer = informer

    def join(self, timeout: float | None = None) -> None:
        self.informer.stop(10.0 if timeout is None else timeout)


def start_watches(cluster: Cluster, api_client: Any, loop: asyncio.AbstractEventLoop,
                  stop: threading.Event) -> list[_Watch]:
    """One pod informer (the ftagent.io/job label, every namespace) and one node informer
    (ftagent/kube/informer.py: list + watch, resume, bookmarks, 410 -> relist with the
    difference handed over, backoff with jitter), handing changes to the cluster on
    ``loop``. ``stop`` set, then ``join``: they end."""
    from ftagent.kube.dra_watch import dra_informers
    from ftagent.kube.informer import node_informer, pod_informer

    pods = pod_informer(api_client, label_selector=JOB_LABEL, loop=loop,
                        handler=lambda c: cluster.on_pod(c.type, c.obj))
    pods.start()  # first: a (re)started arbiter's agents wait for this list
    nodes = node_informer(api_client, loop=loop,
                          handler=lambda c: cluster.on_node(c.type, c.obj))
    watches = [_Watch(pods), _Watch(nodes), *(_Watch(i) for i in dra_informers(
        api_client, loop, cluster.on_resource_slice, cluster.on_resource_claim,
        cluster.on_device_taint_rule))]
    for w in watches[1:]:
        w.informer.start()

    def stopper() -> None:  # ``stop`` set: end both (callers may also join)
        stop.wait()
        for w in watches:
            w.informer.stop(5.0)

    threading.Thread(target=stopper, daemon=True, name="ftagent-watch-stop").start()
    return watches
