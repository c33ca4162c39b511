"""``ftagent node [flags]``: the host agent's flags and composition root (see ftagent/node/).

Every flag also has its FTAGENT_* variable. Reads the host's GPUs (--gpu-backend, as
ftagent run: NVML, the kernel log, or a simulated timeline for drills and tests) and
NICs (--nic; default: the host's physical links, never the pods' veths, which come and
go), reports node-scoped faults to every arbiter in --arbiter (jobs are sharded over
them; ranks of any shard may run here), writes the FtagentGPUHealthy and
FtagentNICHealthy conditions of the Node with --kube-api, and serves the GPU and NIC
series on --metrics-port with the label node. A bad flag is one line and exit 2.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry

from ftagent import metrics_http
from ftagent.config import (
    CONNECTION_FIELDS,
    PORT_OR_OFF,
    POSITIVE_SECONDS,
    ArbiterClientConfig,
    ConfigError,
    GpuConfig,
    HelpFormatter,
    NicConfig,
    OneLineParser,
    Range,
    add_group,
    host,
    name,
    opt,
    resolve_group,
)
from ftagent.node.agent import NodeAgent
from ftagent.node.conditions import HEARTBEAT, NodeConditions
from ftagent.node.reports import HEARTBEAT as REPORT_HEARTBEAT
from ftagent.node.reports import NodeReporter
from ftagent.sources.nic import SYSFS_NET

log = logging.getLogger("ftagent.node")

EPILOG = """\
examples:
  ftagent node --arbiter arbiter-0:9400,arbiter-1:9400 --kube-api in-cluster
  FTAGENT_TOKEN=$(ftagent token --node '*') ftagent node --arbiter arbiter:9400
  ftagent node --gpu-backend simulated:xid79.txt --node node-1 --arbiter 127.0.0.1:9400

--token takes a node token (`ftagent token --node NODE`, or --node '*' for every node):
it may only report for its node. --arbiter lists every shard: all of them get the reports.
"""

NIC_FIELDS = ("nic", "nic_grace", "rdma_sysfs", "nic_poll_interval")  # scope is NODE here


def _kube_api(v: str) -> str:
    if v == "in-cluster" or v.startswith(("http://", "https://")) and v.isprintable():
        return v
    raise ConfigError("is not a URL (http://HOST:PORT, https://...) or in-cluster")


@dataclass(frozen=True)
class NodeConfig:
    """The node agent's own flags (the arbiter, GPU and NIC groups are shared)."""

    node: str = opt("", "--node", "this node's name, as the pods' agents register it "
                    "(default: $NODE_NAME, else the hostname)", check=name, metavar="NODE")
    metrics_port: int = opt(
        9432, "--metrics-port", "Prometheus /metrics port; 0 picks a free port, -1 turns "
        "metrics off", check=PORT_OR_OFF, metavar="PORT")
    metrics_addr: str = opt("0.0.0.0", "--metrics-addr", "address /metrics listens on",
                            check=host, metavar="ADDR")
    health_port: int = opt(
        -1, "--health-port", "port of /healthz for the kubelet's probes (on --metrics-addr), "
        "apart from /metrics so that no flood of scrapes or slow peers there can fail them "
        "(the shipped DaemonSet: 9434); 0 picks a free port; -1: none",
        check=PORT_OR_OFF, metavar="PORT")
    report_interval: float = opt(
        REPORT_HEARTBEAT, "--report-interval", "seconds between heartbeat reports to "
        "each arbiter (faults are sent at once)", check=Range(0.05, 3600),
        metavar="SECONDS")
    kube_api: str = opt(
        "", "--kube-api", "API server for the Node conditions: in-cluster (the pod's "
        "service account) or a URL; unset: no conditions are written",
        check=_kube_api, metavar="URL|in-cluster")
    condition_heartbeat: float = opt(
        HEARTBEAT, "--condition-heartbeat", "the conditions are patched on every "
        "change and at least this often (their lastHeartbeatTime)",
        check=POSITIVE_SECONDS, metavar="SECONDS")
    nic_netns: str = opt(
        "", "--nic-netns", "watch the links of this network namespace (an `ip netns` "
        "name) instead of the agent's own", check=name, metavar="NAME")
    log_level: str = opt("info", "--log-level", "ftagent's own messages on stderr",
                         choices=("debug", "info", "warning", "error"))


@dataclass(frozen=True)
class NodeSettings:
    """Everything ``ftagent node`` needs, from flags and the environment."""

    node: NodeConfig
    arbiter: ArbiterClientConfig
    gpu: GpuConfig
    nic: NicConfig


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="ftagent node", description=__doc__.split("\n\n")[1],
                           epilog=EPILOG, formatter_class=HelpFormatter)
    add_group(parser, "node", NodeConfig)
    add_group(parser, "arbiter connection (every shard gets the reports)", ArbiterClientConfig,
              only=CONNECTION_FIELDS)
    add_group(parser, "GPUs (NVML, kernel log)", GpuConfig)
    add_group(parser, "network links", NicConfig, only=NIC_FIELDS)
    return parser


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> NodeSettings:
    """Flags + environment -> NodeSettings; raises ConfigError for the user to read."""
    ns = build_parser().parse_args(list(argv))
    node = resolve_group(ns, NodeConfig, environ)
    if not node.node:
        node = replace(node, node=_env_node(environ))
    return NodeSettings(
        node=node,
        arbiter=resolve_group(ns, ArbiterClientConfig, environ, only=CONNECTION_FIELDS),
        gpu=resolve_group(ns, GpuConfig, environ),
        nic=replace(resolve_group(ns, NicConfig, environ, only=NIC_FIELDS), nic_scope="node"))


def _env_node(environ: Mapping[str, str]) -> str:
    for var in ("NODE_NAME", "HOSTNAME"):
        v = environ.get(var, "")
        if v:
            try:
                return name(v)
            except ConfigError as e:
                raise ConfigError(f"${var}: {e}") from None
    return os.uname().nodename


def physical_links(sysfs_net: str = SYSFS_NET) -> tuple[str, ...]:
    """The host's physical NICs (their sysfs device is not under devices/virtual): the
    default --nic of the node agent, so the pods' veths, bridges and tunnels, which come
    and go with the pods, are never judged."""
    try:
        names = sorted(os.listdir(sysfs_net))
    except OSError:
        return ()
    return tuple(n for n in names
                 if "/devices/virtual/" not in os.path.realpath(os.path.join(sysfs_net, n)))


def build(s: NodeSettings, environ: Mapping[str, str]) -> tuple[NodeAgent, CollectorRegistry]:
    """The agent and its metrics registry; ConfigError for a bad file or flag combination.

    Its watch is every registered part (watch/registry.py) for the whole host: no
    trainer environment (every GPU the machine shows; the links --nic names, default the
    physical ones), scope NODE."""
    from ftagent.watch.context import WatchContext
    from ftagent.watch.registry import build as build_parts
    from ftagent.watch.registry import register

    node = s.node.node
    labels = {"node": node}
    registry = CollectorRegistry()
    nic_cfg = s.nic
    if not nic_cfg.nic and not s.node.nic_netns:
        nic_cfg = replace(nic_cfg, nic=physical_links() or ("",))
    ctx = WatchContext(s.gpu, replace(nic_cfg, nic_scope="node"), environ, {},
                       netns=s.node.nic_netns or None)
    parts = build_parts(ctx)
    register(parts, registry, labels)
    reporter = None
    if s.arbiter.arbiter:
        try:
            reporter = NodeReporter(s.arbiter.arbiter.split(","), node, uuid.uuid4().hex[:12],
                                    token=s.arbiter.token,
                                    token_file=s.arbiter.token_file, tls_ca=s.arbiter.tls_ca,
                                    tls_cert=s.arbiter.tls_cert, tls_key=s.arbiter.tls_key,
                                    heartbeat=s.node.report_interval)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    writer = None
    if s.node.kube_api:
        from ftagent.node.conditions import KubeNodeStatus, api_client

        try:
            writer = KubeNodeStatus(api_client(s.node.kube_api))
        except ImportError:
            raise ConfigError("--kube-api needs the kubernetes package (pip install "
                              "'ftagent[kube]')") from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    agent = NodeAgent(node, parts=parts, reporter=reporter, writer=writer,
                      conditions=NodeConditions(s.node.condition_heartbeat))
    return agent, registry


async def serve(agent: NodeAgent) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await agent.run()
    except asyncio.CancelledError:
        log.info("node agent stopping")
    return 0


def main(argv: Sequence[str]) -> int:
    environ = dict(os.environ)
    try:
        s = parse(argv, environ)
        logging.basicConfig(level=getattr(logging, s.node.log_level.upper()),
                            format="[ftagent node %(asctime)s] %(levelname)s %(message)s",
                            datefmt="%H:%M:%S", stream=sys.stderr)
        agent, registry = build(s, environ)
    except ConfigError as e:
        sys.stderr.write(f"ftagent node: error: {e} (see ftagent node --help)\n")
        return 2
    if agent.reporter is None:
        log.info("no --arbiter: node faults are logged and exported, not reported")
    port = s.node.metrics_port
    if port >= 0:
        try:
            server, _ = metrics_http.start_http_server(port, s.node.metrics_addr,
                                                       registry=registry)
            log.info("metrics on http://%s:%d/metrics", s.node.metrics_addr, server.server_port)
        except OSError as e:
            log.warning("metrics disabled: cannot listen on %s:%d (%s); use --metrics-port",
                        s.node.metrics_addr, port, e.strerror or e)
    if s.node.health_port >= 0:
        try:
            probes = metrics_http.serve_health(s.node.health_port, s.node.metrics_addr)
            log.info("probes on http://%s:%d/healthz", s.node.metrics_addr,
                     probes.server_port)
        except OSError as e:
            sys.stderr.write(f"ftagent node: error: cannot listen on {s.node.metrics_addr}:"
                             f"{s.node.health_port} (--health-port): {e.strerror or e}\n")
            return 1
    log.info("node agent for %s: GPUs %s, links %s, conditions %s", agent.node,
             f"{s.gpu.accelerator}:{s.gpu.gpu_backend}", ",".join(s.nic.nic) or "physical",
             s.node.kube_api or "off")
    return asyncio.run(serve(agent))
