"""``ftagent run [flags] -- CMD [ARGS...]``: parse flags, wire the agent, run it.

This is the composition root: the one place that decides which sources, detectors and
sinks an agent gets from its configuration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from ftagent import metrics_http
from ftagent.agent.decider import Decider, LocalDecider
from ftagent.agent.launcher import normalize_flags
from ftagent.agent.metrics_sink import MetricsSink
from ftagent.agent.pod import PodAgent
from ftagent.agent.shutdown import Stuck, guard_exit, hard_exit, run_bounded, stuck_line
from ftagent.agent.worker import Worker
from ftagent.agent.worker_parts import WorkerParts
from ftagent.agent.worker_spec import WorkerSpec
from ftagent.config import (
    RUN_GROUPS,
    ConfigError,
    HelpFormatter,
    LaunchConfig,
    OneLineParser,
    RunConfig,
    add_group,
    identity,
    resolve_group,
    split_command,
    unrecognized,
)
from ftagent.metrics import AgentMetrics
from ftagent.model import Fault, Progress
from ftagent.sources.progress import LogObservation
from ftagent.watch.loop import WatchLoop

if TYPE_CHECKING:
    from ftagent.agent.flight_recorder import FlightRecorder
    from ftagent.agent.hang_parts import LocalPeers
    from ftagent.agent.launcher import NodePlace
    from ftagent.agent.standby_memory import StandbyBudget
    from ftagent.agent.tee import Writer

log = logging.getLogger("ftagent")

DESCRIPTION = """\
Run a training command under ftagent: its output passes through byte for byte, it is
restarted on failure (--max-restarts, or job-wide by an arbiter), hangs are detected
from step progress, and metrics are served for Prometheus. Exits with the trainer's exit
status (128+N when killed by signal N); a bad flag or value is one line on stderr and
exit status 2.

Every flag can also be set by the FTAGENT_* variable shown after it.
"""

EPILOG = """\
examples:
  ftagent run --max-restarts 3 -- python train.py --lr 3e-4
  FTAGENT_ARBITER=arbiter:9400 ftagent run --job llama -- torchrun --nproc-per-node 8 train.py
"""


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="ftagent run", description=DESCRIPTION, epilog=EPILOG,
        usage="ftagent run [flags] -- CMD [ARGS...]",
        formatter_class=HelpFormatter)
    for title, cls in RUN_GROUPS.values():
        add_group(parser, title, cls)
    return parser



def parse(argv: Sequence[str], environ: Mapping[str, str]) -> RunConfig:
    """Flags + environment -> RunConfig; raises ConfigError for the user to read."""
    opts, command = split_command(argv)
    opts = normalize_flags(opts)  # torchrun's spellings; its flags ftagent does not take
    parser = build_parser()
    ns, extra = parser.parse_known_args(opts)
    if extra:
        raise ConfigError(unrecognized(extra, separated="--" in argv))
    if not command:
        raise ConfigError("no command to run: ftagent run [flags] -- CMD [ARGS...]")
    origins: dict[str, str] = {}
    groups = {key: resolve_group(ns, cls, environ, origins=origins if key == "identity" else None)
              for key, (_, cls) in RUN_GROUPS.items()}
    groups["identity"] = identity(groups["identity"], environ, origins)
    return RunConfig(command=tuple(command), **groups)


def setup_logging(level: str, rank: int | str) -> None:
    """Log lines name the agent's rank (``rank`` an int) or what it is ("spare")."""
    who = f"rank{rank}" if isinstance(rank, int) else rank
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[ftagent {who} %(asctime)s] %(levelname)s %(message)s",
        datefmt="%H:%M:%S", stream=sys.stderr)


def build_agent(pod: PodAgent, spec: WorkerSpec, rundir: str, *,
                registry: CollectorRegistry | None = None, share: AgentMetrics | None = None,
                node_sources: bool = True, budget: StandbyBudget | None = None,
                local_peers: LocalPeers | None = None) -> Worker:
    """One worker of ``pod`` (the trainer's, or one launcher worker's with the spec's
    ``local_rank``: its series join ``share``'s families in the pod's ``registry``,
    ``node_sources`` says whether it carries the node's GPU and NIC sources). Its
    decider: the arbiter link with --arbiter (failing open to the pod's local policy),
    else the local policy. Raises ConfigError for settings only checkable here (e.g. TLS
    files)."""
    cfg, environ, local_rank = spec.cfg, spec.environ, spec.local_rank
    ids = cfg.identity
    labels = {"job_name": ids.job, "namespace": ids.namespace, "pod": ids.pod, "node": ids.node,
              "rank": str(ids.rank)}
    if local_rank is not None:
        labels["local_rank"] = str(local_rank)
    serve = registry is None
    registry = CollectorRegistry() if registry is None else registry
    metrics = AgentMetrics(registry, labels, share=share)
    metrics.share_identity(labels)  # the GPU and NIC collectors' (a spare's rank changes)
    from ftagent.agent.flight_recorder import flight_recorder_parts, prepare_recorder
    from ftagent.agent.standby import warm_restart_parts
    from ftagent.agent.standby_memory import StandbyBudget

    if budget is None:  # one per process: the launcher's workers share theirs
        budget = StandbyBudget(cfg.supervisor.warm_restart_memory_share)
    standbys = budget
    from ftagent.agent.standby_memory import container_memory
    from ftagent.checkpoint.agent_env import snapshot_env
    from ftagent.checkpoint.persister import BackgroundPersist
    mem = container_memory()
    memory_limit = mem.limit if mem is not None else None
    nproc = cfg.launch.nproc_per_node or "1"

    def parts(w: Worker) -> WorkerParts:
        """The worker's parts, in the order they see what happens: the metrics sink, the
        progress sources and hang detector, the spawn seam (a warm standby, else cold),
        the flight recorder (TORCH_FR_* env, its per-attempt directory before each
        start), the node's GPUs and links."""
        sink = MetricsSink(metrics, lifecycle=w.lifecycle)
        p = WorkerParts(observers=(sink,), fault_hooks=(sink.on_fault,))
        fr = prepare_recorder(w, cfg, rundir)  # before the hang parts: the verifier dumps it
        p = progress_parts(w, cfg, metrics, rundir, p, fr, local_peers)
        p = warm_restart_parts(w, cfg, rundir, p, standbys)
        p = flight_recorder_parts(w, cfg, rundir, p, fr)
        watch = None
        if node_sources:  # the host's GPUs and links: one source of the agent (ftagent/watch/)
            watch = add_watch(w, cfg, environ, registry, labels)
            p = p.plus(sources=[watch])
        snap = cfg.snapshot
        p = p.plus(env=snapshot_env(snap, ids.job, limit=memory_limit,
                                    workers=int(nproc) if nproc.isdigit() else 1))
        if snap.checkpoint_dir and (snap.persist_every or snap.persist_seconds):
            p = p.plus(observers=[BackgroundPersist(
                os.path.abspath(snap.snapshot_dir), ids.job, lambda: w.lifecycle.rank,
                os.path.abspath(snap.checkpoint_dir), every=snap.persist_every,
                seconds=snap.persist_seconds)])
        if snap.replica_peer or snap.replica_listen:
            from ftagent.checkpoint.replica_agent import replica_parts
            p = replica_parts(w, cfg, ids.job, p, on_lag=metrics.snapshot_replica_lag.set)
        return preflight_parts(w, cfg, watch, p)

    agent = pod.add(spec, metrics=metrics, parts=parts)
    if serve:
        start_metrics(cfg, registry, agent)
    return agent


def preflight_parts(w: Worker, cfg: RunConfig, watch: Any, p: WorkerParts) -> WorkerParts:
    """``p`` with preflight before each barrier (agent/preflight.py), unless
    --no-preflight: the full budgets at this agent's first start (a new pod, a new
    node), the fast ones for a restart in place (--preflight-warm)."""
    sup = cfg.supervisor
    if not sup.preflight:
        return p
    from ftagent.agent.preflight import Preflight, rendezvous
    from ftagent.detect.preflight import fault_of

    check = Preflight(watch, sup.preflight_checkpoint_dir,
                      full_on_warm=sup.preflight_warm == "full")

    async def before_barrier(worker: Worker) -> Fault | None:
        warm = worker.restarts > 0
        check.peer = rendezvous(worker.environ, worker.ident.rank)  # (a spare's rank moves)
        v = await check.run(warm=warm)
        worker.events.write("state", "preflight", v.reason or "preflight passed",
                            generation=worker.generation, ok=v.ok, failed=list(v.failed),
                            preflight_seconds=round(v.seconds, 3), fast=warm)
        link = arbiter_link(worker)  # the arbiter's ledger counts it (its arrival)
        proto = getattr(link, "proto", None)
        if proto is not None:
            proto.preflight_seconds = v.seconds
        if v.ok:
            log.debug("preflight passed in %.3fs", v.seconds)
            return None
        log.error("%s (generation %d)", v.reason, worker.generation)
        return fault_of(v, worker.generation)

    return p.plus(before_barrier=[before_barrier])


def arbiter_link(worker: Worker) -> Any:
    """``worker``'s link to the arbiter (None without one), looked up when used: the parts
    are built before the worker takes its seat, so none of them keeps it."""
    link_of = getattr(worker.decider, "link_of", None)
    return link_of(worker) if link_of is not None else None


def pod_decider(cfg: RunConfig) -> Decider:
    """The pod's one decider: the arbiter's with --arbiter (failing open to the local
    policy), else the local policy."""
    if cfg.arbiter.arbiter:
        from ftagent.agent.arbiter_decider import ArbiterDecider

        return ArbiterDecider()
    return LocalDecider()


def build_workers(cfg: RunConfig, environ: Mapping[str, str], rundir: str) -> PodAgent:
    """``--nproc-per-node N``: a pod of N workers, one per local rank, with torchrun's
    environment (agent/launcher.py), sharing the pod's reaper, one /metrics port and the
    pod's local group (what the local policy decides, alone or failing open under an
    arbiter, stops and restarts them all). Raises ConfigError for the user to read."""
    from ftagent.agent import launcher
    from ftagent.agent.trainer_exec import WORKER_VAR

    launch = cfg.launch
    place = launcher.node_place(launch, cfg.identity, environ,
                                gpus=launcher.visible_gpus(environ))
    if place.master_port == 0:  # --standalone
        place = dataclasses.replace(place, master_port=launcher.free_tcp_port())
    command = launcher.worker_command(launch, cfg.command, environ, os.getcwd())
    pod = PodAgent(pod_decider(cfg))
    registry = CollectorRegistry()
    from ftagent.agent.standby_memory import StandbyBudget

    budget = StandbyBudget(cfg.supervisor.warm_restart_memory_share)
    from ftagent.agent.hang_parts import LocalPeers

    peers = LocalPeers()  # each worker's verifier joins it when built (agent/hang_parts.py)
    workers: list[Worker] = []
    logroot = ""
    if launch.log_dir or any(launcher.std_of(launch.tee, i) or
                             launcher.std_of(launch.redirects, i) for i in range(place.nproc)):
        base = launch.log_dir or rundir
        os.makedirs(base, exist_ok=True)
        logroot = tempfile.mkdtemp(prefix=f"{place.run_id}_", dir=base)
    shown = launcher.ranks_filter(launch.local_ranks_filter)
    console_lock = threading.Lock()  # every worker's prefixed lines go out whole
    for i in range(place.nproc):
        ident = dataclasses.replace(cfg.identity, rank=place.rank(i),
                                    world_size=place.world_size,
                                    job=cfg.identity.job if cfg.identity.job != "local"
                                    or place.run_id == "none" else place.run_id)
        wcfg = dataclasses.replace(cfg, command=command, identity=ident)
        wdir = os.path.join(rundir, f"worker{i}")
        os.makedirs(wdir, exist_ok=True)
        env = launcher.worker_env(environ, place, i, restart_count=0,
                                  max_restarts=cfg.supervisor.max_restarts)
        env[WORKER_VAR] = str(i)
        spec = WorkerSpec(wcfg, env, local_rank=i, attempt_env=_attempt_env(wdir),
                          outputs=_outputs(launch, place, i, logroot, shown, environ,
                                           console_lock))
        share = workers[0].metrics if workers else None
        workers.append(build_agent(pod, spec, wdir, registry=registry, share=share,
                                   node_sources=i == 0, budget=budget, local_peers=peers))
    start_metrics(cfg, registry, workers[0])
    log.info("launching %d worker(s): ranks %d-%d of %d, master %s:%d, run id %s",
             place.nproc, place.rank(0), place.rank(place.nproc - 1), place.world_size,
             place.master_addr, place.master_port, place.run_id)
    return pod


def _attempt_env(wdir: str) -> Callable[[int], dict[str, str]]:
    """torchrun's per-attempt variables: the restart count and the error file (where
    ``@record`` writes the worker's traceback)."""

    def env(attempt: int) -> dict[str, str]:
        d = os.path.join(wdir, f"attempt_{attempt}")
        os.makedirs(d, exist_ok=True)
        return {"TORCHELASTIC_RESTART_COUNT": str(attempt),
                "TORCHELASTIC_ERROR_FILE": os.path.join(d, "error.json")}

    return env


def _outputs(launch: LaunchConfig, place: NodePlace, i: int, logroot: str,
             shown: set[int] | None, environ: Mapping[str, str],
             console_lock: threading.Lock | None = None,
             ) -> Callable[[int], tuple[int | Writer, int | Writer]]:
    """Where worker ``i``'s streams go, per attempt, as torchrun's --tee/--redirects/
    --log-dir/--local-ranks-filter say: the console (prefixed when tee'd) and/or
    LOGROOT/attempt_N/LOCAL_RANK/{stdout,stderr}.log."""
    from ftagent.agent import launcher
    from ftagent.agent.tee import WorkerOutput

    tee, red = launcher.std_of(launch.tee, i), launcher.std_of(launch.redirects, i)
    prefix = launcher.line_prefix(place, i, environ)
    visible = shown is None or i in shown
    opened: list[WorkerOutput] = []

    def outputs(attempt: int) -> tuple[int | Writer, int | Writer]:
        for o in opened:  # the previous attempt's pumps have drained
            o.close()
        opened.clear()
        if not (tee | red) and visible:
            return 1, 2  # as is: byte for byte, no prefix (torchrun's default)
        d = os.path.join(logroot, f"attempt_{attempt}", str(i)) if logroot else ""
        if d:
            os.makedirs(d, exist_ok=True)
        streams: list[int | Writer] = []
        for bit, fd, name in ((1, 1, "stdout"), (2, 2, "stderr")):
            to_file = bool((tee | red) & bit)
            console = fd if visible and (tee & bit or not red & bit) else None
            out = WorkerOutput(console, prefix if tee & bit else b"",
                               os.path.join(d, f"{name}.log") if to_file and d else None,
                               console_lock)
            opened.append(out)
            streams.append(out)
        return streams[0], streams[1]

    return outputs


def progress_parts(agent: Worker, cfg: RunConfig, metrics: AgentMetrics, rundir: str,
                   parts: WorkerParts, recorder: FlightRecorder | None = None,
                   local_peers: LocalPeers | None = None) -> WorkerParts:
    """``parts`` with step progress from the trainer's log lines and/or the SDK, the hang
    detector (and its verifier, its parts built first: agent/hang_parts.py; its evidence)
    and the loss detector."""
    from ftagent.agent.hang_watch import HangWatch
    from ftagent.agent.worker_evidence import evidence_hook, tail
    from ftagent.detect.hang import HangDetector
    from ftagent.sources.progress import LogProgress
    from ftagent.sources.sdk_socket import SdkSocketSource

    mode = cfg.hang.progress
    if mode == "none":  # parameter servers, launchers: supervised for crashes only
        return parts
    parser = None
    if mode in ("auto", "log"):
        parser = LogProgress(cfg.hang.progress_regex)

        def on_lines(stream: str, blob: bytes, ts: float, p: LogProgress = parser) -> None:
            for obs in latest_progress(p.parse_blob(blob, ts)):
                agent.observe(obs)

        parts = parts.plus(line_handlers=[on_lines])
    if mode in ("auto", "sdk"):
        sdk = SdkSocketSource(os.path.join(rundir, "sdk.sock"), phases=metrics.phase_names,
                              ops=metrics.op_names)
        try:
            sdk.bind()
        except OSError as e:
            log.warning("SDK socket unavailable (%s); progress from logs only", e)
        else:
            metrics.attach_sdk(sdk)
            parts = parts.plus(sources=[sdk], env={"FTAGENT_SDK_SOCKET": sdk.path})
    detector = HangDetector(cfg.hang)
    verifier = None
    if cfg.hang.hang_verify_window > 0:  # suspect -> verify -> declare (agent/verify.py)
        from ftagent.agent.verify import NvmlProbe, TreeSampler, Verifier

        sampler = TreeSampler(dump_timeout=min(cfg.hang.hang_dump_timeout, 2.0),
                              gpu=NvmlProbe(), tree=agent.tree)
        def learned(seconds: float, where: str) -> None:
            says = getattr(arbiter_link(agent), "trainer_says", None)
            if says is not None:
                says.learned(seconds, where)

        from ftagent.agent.hang_parts import HangParts
        from ftagent.agent.proc_wait import blocked_threads

        asks = None  # alert: the arbiter decides no hang at all
        connected = getattr(agent.decider, "connected", None)  # the arbiter's decider
        if cfg.arbiter.arbiter and cfg.hang.hang_action != "alert" and connected is not None:
            asks = functools.partial(connected, agent)  # read in the decider, not through here
        # the rank read in place from its owner, the lifecycle (no callback through here)
        hang = HangParts(rank=agent.lifecycle, ask_arbiter=asks,
                         local_peers=local_peers,
                         window_dump=None if recorder is None else recorder.snapshot,
                         waits=blocked_threads, wake=agent.wake_ticker)
        # the events file's write itself; the arbiter's link told of each phase learned;
        # the detectors' clock read from the worker's line feed itself (no hop through
        # the worker: the early sampling ticks the budget's end with it)
        verifier = Verifier(detector, cfg.hang, sampler, hang, record=agent.events.write,
                            metrics=metrics, emit=agent.raise_fault, now=agent.feed.now,
                            learned=learned if cfg.arbiter.arbiter else None)
    watch = HangWatch(detector, metrics, parser, verifier=verifier)
    parts = parts.plus(detectors=[watch])
    if cfg.loss.loss_action != "off":  # NaN/inf and spikes of the loss (detect/loss.py)
        from ftagent.detect.loss import LossDetector, LossSettings

        parts = parts.plus(detectors=[LossDetector(LossSettings.of(cfg.loss))])
    if cfg.snapshot.checkpoint_dir:  # LAST_WORDS: a planned disruption (arbiter only)
        parts = parts.with_(on_last_words=lambda: last_words_now(cfg, agent))
    # the rank's arbiter session calls these back (seat.py RankHooks, given with the seat)
    parts = parts.with_(hang_state=watch.state)  # the progress summaries carry it
    if verifier is not None:  # DUMP_STACKS + liveness
        stacks_for_arbiter = verifier.stacks_for_arbiter

        async def stacks() -> dict[str, Any]:
            return await stacks_for_arbiter(agent.tree_pids())

        parts = parts.with_(stacks=stacks)
    if verifier is not None and cfg.arbiter.arbiter:  # waiting is not hanging
        from ftagent.agent.peer_wait import PeerWait

        waits = PeerWait(lambda: agent.lifecycle.rank, verifier, agent.events.write, metrics,
                         culprit_spin_timeout=cfg.hang.hang_culprit_spin_timeout)
        parts = parts.plus(observers=[waits]).with_(on_busy=waits.on_action)
    # the last lines read from the worker's ring itself (worker_evidence.tail), not
    # through the worker's method that only passes them on
    last = functools.partial(tail, agent.last_lines)
    return parts.with_(evidence=evidence_hook(cfg.hang.hang_dump_timeout, last))


def add_watch(agent: Worker, cfg: RunConfig, environ: Mapping[str, str],
              registry: CollectorRegistry, labels: dict[str, str]) -> WatchLoop:
    """The watch loop over every registered part (watch/registry.py: the links and RDMA
    ports, the GPUs or a vendor's accelerators), its series in ``registry``, its faults
    raised by ``agent`` (evidence, events, the decider). ConfigError for a bad setting."""
    from ftagent.agent import supervisor
    from ftagent.model import FaultKind
    from ftagent.watch.context import WatchContext
    from ftagent.watch.registry import assemble

    ctx = WatchContext(cfg.gpu, cfg.nic, environ, environ, rank=cfg.identity.rank,
                       hide=supervisor.hide_from_tree, show=supervisor.show_in_tree)
    return assemble(ctx, agent.raise_fault, metrics=registry, labels=labels,
                    on_error=lambda name, e: agent.events.write(
                        "fault", FaultKind.AGENT.value, f"source {name} failed: {e}"))


def latest_progress(batch: list[LogObservation]) -> list[LogObservation]:
    """Lines read together share one timestamp, so of consecutive steps in a batch only
    the last carries timing (their zero intervals are pipe buffering, not steps); phase
    markers (and Megatron's timings) keep their place between them. The folded steps'
    losses ride along on the last (``Progress.folded_losses``) for the loss detector."""
    out: list[LogObservation] = []
    folded: list[tuple[int, float]] = []
    for i, o in enumerate(batch):
        if isinstance(o, Progress) and i + 1 < len(batch) and isinstance(batch[i + 1], Progress):
            if o.loss is not None:
                folded.append((o.step, o.loss))
            continue
        if folded and isinstance(o, Progress):
            o = dataclasses.replace(o, folded_losses=tuple(folded))
        folded = []
        out.append(o)
    return out


def start_metrics(cfg: RunConfig, registry: CollectorRegistry, agent: Worker) -> None:
    """Serve /metrics; a port that cannot be bound is a warning, never a failure."""
    port = cfg.metrics.metrics_port
    if port < 0:
        return
    try:
        server, _ = metrics_http.start_http_server(port, cfg.metrics.metrics_addr,
                                                   registry=registry)
    except OSError as e:
        log.warning("metrics disabled: cannot listen on %s:%d (%s); use --metrics-port",
                    cfg.metrics.metrics_addr, port, e.strerror or e)
        return
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", cfg.metrics.metrics_addr, bound)
    agent.events.write("state", "metrics", f"serving metrics on port {bound}",
                       metrics_port=bound)


# The agent's credential, never the trainer's (user code): read into the config, then gone
# from the environment every child process is started with.
CREDENTIAL_VARS = ("FTAGENT_TOKEN", "FTAGENT_TOKEN_FILE")


def scrub_credentials(environ: dict[str, str]) -> None:
    """Drop the agent's credential variables from ``environ`` (the trainer's environment)
    and from this process's own (what any other child inherits)."""
    for name in CREDENTIAL_VARS:
        environ.pop(name, None)
        os.environ.pop(name, None)


def say_last_words(cfg: RunConfig, pod: PodAgent) -> None:
    """The pod is going (a stop signal): its ranks' newest complete snapshots go to
    --checkpoint-dir (checkpoint/lastwords.py), within --stop-timeout."""
    from ftagent.checkpoint.lastwords import last_words
    ranks = sorted({w.ident.rank for w in pod.workers if w.ident.rank >= 0})
    try:
        last_words(os.path.abspath(cfg.snapshot.snapshot_dir), cfg.identity.job, ranks,
                   os.path.abspath(cfg.snapshot.checkpoint_dir),
                   deadline=time.monotonic() + cfg.supervisor.stop_timeout)
    except Exception as e:  # noqa: BLE001 - the trainer's exit status comes first
        log.warning("last words failed: %s: %s", type(e).__name__, e)


async def last_words_now(cfg: RunConfig, worker: Worker) -> None:
    """The arbiter's LAST_WORDS (this rank's node announced a planned disruption): the
    rank's newest complete snapshots go to --checkpoint-dir now, in a thread, within
    --stop-timeout; the trainer keeps running. Said as a "last_words" state event."""
    from ftagent.checkpoint.lastwords import last_words
    rank = worker.ident.rank
    if rank < 0:
        return
    said = await asyncio.to_thread(
        last_words, os.path.abspath(cfg.snapshot.snapshot_dir), cfg.identity.job, [rank],
        os.path.abspath(cfg.snapshot.checkpoint_dir),
        deadline=time.monotonic() + cfg.supervisor.stop_timeout)
    for s in said:
        msg = (f"persisted step(s) {', '.join(map(str, s.persisted))}" if s.persisted
               else "no complete snapshot to persist") + f" in {s.seconds:.2f}s"
        log.info("last words (a planned disruption of the node): %s", msg)
        worker.events.write("state", "last_words", msg, persisted=list(s.persisted),
                            seconds=round(s.seconds, 3), left=list(s.left))


def main(argv: Sequence[str]) -> int:
    environ = dict(os.environ)
    try:
        cfg = parse(argv, environ)
    except ConfigError as e:
        sys.stderr.write(f"ftagent run: error: {e} (see ftagent run --help)\n")
        return 2
    if cfg.identity.spare and (cfg.launch.nproc_per_node or not cfg.arbiter.arbiter):
        why = "--nproc-per-node (launcher mode)" if cfg.arbiter.arbiter else "no --arbiter"
        sys.stderr.write(f"ftagent run: error: --spare is for single-worker pods under an "
                         f"arbiter (it assigns the spare a rank), not with {why} (see "
                         "ftagent run --help)\n")
        return 2
    setup_logging(cfg.supervisor.log_level, "spare" if cfg.identity.spare else cfg.identity.rank)
    scrub_credentials(environ)
    rundir = tempfile.mkdtemp(prefix="ftagent-")
    try:
        try:
            if cfg.launch.nproc_per_node:
                pod = build_workers(cfg, environ, rundir)
            else:
                pod = PodAgent(pod_decider(cfg))
                build_agent(pod, WorkerSpec(cfg, environ), rundir)
        except ConfigError as e:
            sys.stderr.write(f"ftagent run: error: {e} (see ftagent run --help)\n")
            return 2
        # asyncio.run's end awaits every task and executor thread without a bound: a task
        # that does not end when cancelled kept a finished pod running (shutdown.py)
        try:
            result, stuck = run_bounded(pod.run(), lambda: exit_deadline(cfg, pod))
        except Exception:  # a bug of the agent's: its traceback, status 1, a bounded exit
            guard_exit(1, exit_deadline(cfg, pod), cfg.supervisor.exit_timeout)
            raise
        if pod.stop_signal is not None and cfg.snapshot.checkpoint_dir:
            say_last_words(cfg, pod)
        code = result.exit_status
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
    return bounded_exit(code, stuck, exit_deadline(cfg, pod), cfg.supervisor.exit_timeout,
                        pod.stop_signal is not None)


def exit_deadline(cfg: RunConfig, pod: PodAgent) -> float:
    """When the agent's cleanup must be over: the latest of its workers' (each set as its
    trainer's last exit ended its control loop: Worker.run), else --exit-timeout from now."""
    ends = [w.exit_deadline for w in pod.workers if w.exit_deadline is not None]
    return max(ends) if ends else time.monotonic() + cfg.supervisor.exit_timeout


def bounded_exit(code: int, stuck: list[Stuck], deadline: float, bound: float,
                 signalled: bool = False) -> int:
    """``code`` back to the caller (the interpreter's exit), its exit bounded: tasks that
    did not end are named in one error line and the process ends now (hard_exit: their
    coroutines would run their ``finally`` blocks outside a loop at finalization, and what
    did not end once is not trusted to); else the exit guard is armed for threads that
    would hold the interpreter's exit past ``deadline``. ``signalled``: a stop signal cut
    the bound (the line says so)."""
    if stuck:
        log.error("%s", stuck_line(stuck, code, bound, signalled))
        if threading.current_thread() is threading.main_thread():
            hard_exit(code)
        return code
    guard_exit(code, deadline, bound, signalled)
    return code
