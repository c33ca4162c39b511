"""``ftagent run [flags] -- CMD [ARGS...]``: parse flags, wire the agent, run it.

This is the composition root: the one place that decides which sources, detectors and
sinks an agent gets from its configuration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, start_http_server

from ftagent.agent.agent import Agent
from ftagent.agent.metrics_sink import MetricsSink
from ftagent.config import (
    RUN_GROUPS,
    ConfigError,
    HelpFormatter,
    OneLineParser,
    RunConfig,
    add_group,
    identity,
    resolve_group,
    split_command,
)
from ftagent.metrics import AgentMetrics
from ftagent.model import PhaseMarker, Progress

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
    parser = build_parser()
    ns = parser.parse_args(opts)
    if not command:
        raise ConfigError("no command to run: ftagent run [flags] -- CMD [ARGS...]")
    origins: dict[str, str] = {}
    groups = {key: resolve_group(ns, cls, environ, origins=origins if key == "identity" else None)
              for key, (_, cls) in RUN_GROUPS.items()}
    groups["identity"] = identity(groups["identity"], environ, origins)
    return RunConfig(command=tuple(command), **groups)


def setup_logging(level: str, rank: int) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[ftagent rank{rank} %(asctime)s] %(levelname)s %(message)s",
        datefmt="%H:%M:%S", stream=sys.stderr)


def build_agent(cfg: RunConfig, environ: Mapping[str, str], rundir: str) -> Agent:
    """Raises ConfigError for settings only checkable here (e.g. TLS files)."""
    if cfg.arbiter.arbiter:
        from ftagent.agent.arbitrated import ArbitratedAgent

        agent: Agent = ArbitratedAgent(cfg, environ)
    else:
        agent = Agent(cfg, environ)
    ids = cfg.identity
    labels = {"job": ids.job, "namespace": ids.namespace, "pod": ids.pod, "node": ids.node,
              "rank": str(ids.rank)}
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, labels)
    sink = MetricsSink(metrics)
    agent.observers.append(sink)
    agent.fault_hooks.append(sink.on_fault)
    agent.metrics = metrics  # type: ignore[attr-defined]
    add_progress(agent, cfg, metrics, rundir)
    add_nic(agent, cfg, environ, registry, labels)
    add_gpu(agent, cfg, environ, registry, labels)
    start_metrics(cfg, registry, agent)
    return agent


def add_progress(agent: Agent, cfg: RunConfig, metrics: AgentMetrics, rundir: str) -> None:
    """Step progress from the trainer's log lines and/or the SDK, and the hang detector."""
    from ftagent.agent.hang_watch import HangWatch, evidence_hook
    from ftagent.detect.hang import HangDetector
    from ftagent.sources.progress import LogProgress
    from ftagent.sources.sdk_socket import SdkSocketSource

    mode = cfg.hang.progress
    if mode == "none":  # parameter servers, launchers: supervised for crashes only
        return
    parser = None
    if mode in ("auto", "log"):
        parser = LogProgress(cfg.hang.progress_regex)

        def on_lines(stream: str, blob: bytes, ts: float, p: LogProgress = parser) -> None:
            for obs in latest_progress(p.parse_blob(blob, ts)):
                agent.observe(obs)

        agent.line_handlers.append(on_lines)
    if mode in ("auto", "sdk"):
        sdk = SdkSocketSource(os.path.join(rundir, "sdk.sock"), metrics=metrics)
        try:
            sdk.bind()
        except OSError as e:
            log.warning("SDK socket unavailable (%s); progress from logs only", e)
        else:
            agent.sources.append(sdk)
            agent.extra_env["FTAGENT_SDK_SOCKET"] = sdk.path
    detector = HangDetector(cfg.hang)
    verifier = None
    if cfg.hang.hang_verify_window > 0:  # suspect -> verify -> declare (agent/verify.py)
        from ftagent.agent.verify import NvmlProbe, TreeSampler, Verifier

        sampler = TreeSampler(agent.tree_pids, min(cfg.hang.hang_dump_timeout, 2.0),
                              gpu=NvmlProbe())
        verifier = Verifier(detector, cfg.hang, sampler, record=agent.events.write,
                            metrics=metrics, emit=agent.raise_fault)
    watch = HangWatch(detector, metrics, parser, verifier=verifier)
    agent.detectors.append(watch)
    if hasattr(agent, "hang_state"):  # the arbiter's progress summaries carry it
        agent.hang_state = watch.state
    if verifier is not None and hasattr(agent, "stack_capture"):  # DUMP_STACKS + liveness
        agent.stack_capture = verifier.stacks_for_arbiter
    agent.evidence = evidence_hook(cfg.hang.hang_dump_timeout, agent.tail)


def add_nic(agent: Agent, cfg: RunConfig, environ: Mapping[str, str],
            registry: CollectorRegistry, labels: dict[str, str]) -> None:
    """Links through netlink, RDMA ports through sysfs, one debounce detector for both."""
    from ftagent.detect.nic import NicDetector
    from ftagent.metrics import NicCollector
    from ftagent.model import Scope
    from ftagent.sources.nic import NicSource
    from ftagent.sources.rdma import RdmaSource

    scope = Scope.NODE if cfg.nic.nic_scope == "node" else Scope.POD
    detector = NicDetector(cfg.nic.nic_grace, scope=scope)
    nic = NicSource(cfg.nic, environ, flaps=detector.flaps)
    rdma = RdmaSource(cfg.nic, environ, flaps=detector.flaps)
    agent.sources += [nic, rdma]
    agent.detectors.append(detector)
    registry.register(NicCollector(labels, nic.snapshot, rdma.snapshot))


def add_gpu(agent: Agent, cfg: RunConfig, environ: Mapping[str, str],
            registry: CollectorRegistry, labels: dict[str, str]) -> None:
    """The trainer's GPUs through NVML and the kernel log, one Xid detector for both."""
    from ftagent.detect.gpu import GpuDetector, parse_xid_actions
    from ftagent.metrics import GpuCollector
    from ftagent.sources.gpu import GpuSource, open_backend

    factory, feed = open_backend(cfg.gpu, cfg.identity.rank)  # ConfigError: a bad FILE
    if factory is None:
        return
    try:
        overrides, default = parse_xid_actions(cfg.gpu.gpu_xid_action)
    except ValueError as e:
        raise ConfigError(f"--gpu-xid-action {e}") from None
    source = GpuSource(cfg.gpu, environ, factory, feed)
    detector = GpuDetector(overrides=overrides, default=default, devices=source.device)
    agent.sources.append(source)
    agent.detectors.append(detector)
    registry.register(GpuCollector(labels, source.readings, detector.xid_counts,
                                   detector.healthy, lambda: dict(source.event_counts)))


def latest_progress(batch: list[Progress | PhaseMarker]) -> list[Progress | PhaseMarker]:
    """Lines read together share one timestamp, so of consecutive steps in a batch only
    the last carries information (their zero intervals are pipe buffering, not steps);
    phase markers keep their place between them."""
    return [o for i, o in enumerate(batch)
            if not (isinstance(o, Progress) and i + 1 < len(batch)
                    and isinstance(batch[i + 1], Progress))]


def start_metrics(cfg: RunConfig, registry: CollectorRegistry, agent: Agent) -> None:
    """Serve /metrics; a port that cannot be bound is a warning, never a failure."""
    port = cfg.metrics.metrics_port
    if port < 0:
        return
    try:
        server, _ = start_http_server(port, cfg.metrics.metrics_addr, registry=registry)
    except OSError as e:
        log.warning("metrics disabled: cannot listen on %s:%d (%s); use --metrics-port",
                    cfg.metrics.metrics_addr, port, e.strerror or e)
        return
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", cfg.metrics.metrics_addr, bound)
    agent.events.write("state", "metrics", f"serving metrics on port {bound}",
                       metrics_port=bound)


def main(argv: Sequence[str]) -> int:
    environ = dict(os.environ)
    try:
        cfg = parse(argv, environ)
    except ConfigError as e:
        sys.stderr.write(f"ftagent run: error: {e} (see ftagent run --help)\n")
        return 2
    setup_logging(cfg.supervisor.log_level, cfg.identity.rank)
    rundir = tempfile.mkdtemp(prefix="ftagent-")
    try:
        try:
            agent = build_agent(cfg, environ, rundir)
        except ConfigError as e:
            sys.stderr.write(f"ftagent run: error: {e} (see ftagent run --help)\n")
            return 2
        return asyncio.run(agent.run())
    finally:
        shutil.rmtree(rundir, ignore_errors=True)
