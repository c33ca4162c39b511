"""``ftagent webhook``: the admission webhook that injects ftagent into training pods.

Serves ``POST /mutate`` over HTTPS (``GET /healthz``, ``GET /metrics`` too). The
certificate comes from ``--tls-cert/--tls-key`` (cert-manager) or ``--self-signed``: a CA
and certificate made at start-up; with ``--webhook-config`` they are shared by every
replica through the Secret ``--tls-secret`` and the CA is written into that
MutatingWebhookConfiguration's ``caBundle`` (needs the RBAC in deploy/). On start it prints
``listening on HOST:PORT`` on stderr. Exit status 2 for a bad flag or TLS file, 1 when the
address cannot be bound or the cluster refuses the certificate set-up. Rotated
``--tls-cert/--tls-key`` files are served from the next handshake on.

The webhook holds and mints no credential: an injected agent authenticates with its pod's
own projected ServiceAccount token (audience ``--token-audience``), which the kubelet
writes, and verifies the arbiter with the CA from ``--arbiter-ca``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftagent import __version__
from ftagent.config import (
    ConfigError,
    HelpFormatter,
    OneLineParser,
    Range,
    add_group,
    host_port,
    opt,
    resolve_group,
    split_host_port,
)

if TYPE_CHECKING:
    from ftagent.kube.webhook import CertReloader, Counters, WebhookServer

PROG = "ftagent webhook"

EPILOG = """\
examples:
  ftagent webhook --self-signed --ca-bundle-out ca.pem --listen 127.0.0.1:8443
  ftagent webhook --tls-cert tls.crt --tls-key tls.key --arbiter-ca /etc/ftagent-ca/ca.crt \\
      --arbiter ftagent-arbiter.ftagent-system.svc:9400 --image ghcr.io/ftagent/ftagent:0.1.0
"""


@dataclass(frozen=True)
class WebhookConfig:
    listen: str = opt("0.0.0.0:8443", "--listen", "HOST:PORT to serve HTTPS on (port 0 "
                      "picks a free one)", metavar="HOST:PORT")
    tls_cert: str = opt("", "--tls-cert", "serving certificate (PEM)", metavar="PATH")
    tls_key: str = opt("", "--tls-key", "its private key (PEM)", metavar="PATH")
    self_signed: bool = opt(False, "--self-signed", "make a CA and a serving certificate at "
                            "start instead of --tls-cert/--tls-key")
    ca_bundle_out: str = opt("", "--ca-bundle-out", "with --self-signed: write the CA here",
                             metavar="PATH")
    service: str = opt("ftagent-webhook", "--service", "the webhook's Service (names in the "
                       "self-signed certificate)", metavar="NAME")
    service_namespace: str = opt("", "--service-namespace", "its namespace (default: "
                                 "$POD_NAMESPACE, else ftagent-system)", metavar="NS")
    webhook_config: str = opt("", "--webhook-config", "with --self-signed: share the "
                              "certificate through --tls-secret and write the CA into this "
                              "MutatingWebhookConfiguration", metavar="NAME")
    tls_secret: str = opt("ftagent-webhook-tls", "--tls-secret", "Secret the replicas share "
                          "the self-signed certificate in", metavar="NAME")
    image: str = opt(f"ghcr.io/ftagent/ftagent:{__version__}", "--image", "ftagent image "
                     "of the init container that copies the agent into the pod",
                     metavar="IMAGE")
    arbiter: str = opt("", "--arbiter", "arbiter HOST:PORT the agents connect to (none: "
                       "agents decide locally)", check=host_port, metavar="HOST:PORT")
    arbiter_ca: str = opt("", "--arbiter-ca", "the arbiter's CA bundle (PEM) that agents "
                          "verify it with; re-read when it changes; absent file: none",
                          metavar="FILE")
    token_audience: str = opt("ftagent", "--token-audience", "audience of the projected "
                              "ServiceAccount token agents present (the arbiter's)",
                              metavar="AUDIENCE")
    image_pull_secrets: tuple[str, ...] = opt((), "--image-pull-secret", "Secret in the "
                                              "pod's namespace to pull --image with "
                                              "(repeat, or comma-separated)", metavar="NAME")
    tls_reload_interval: float = opt(10.0, "--tls-reload-interval", "how often to look for "
                                     "rotated --tls-cert/--tls-key files",
                                     check=Range(0.05, 3600), metavar="SECONDS")
    metrics_port: int = opt(9440, "--agent-metrics-port", "agents' /metrics port; "
                            "hostNetwork pods get one of PORT..PORT+SPAN-1 (keep it clear of "
                            "ftagent's own ports, 9400-9439)",
                            check=Range(1, 65535 - 1000), metavar="PORT")
    metrics_port_span: int = opt(100, "--agent-metrics-port-span", "ports hostNetwork pods "
                                 "spread over", check=Range(1, 1000), metavar="SPAN")
    max_body: int = opt(4 * 1024 * 1024, "--max-body", "largest AdmissionReview accepted",
                        check=Range(1024, 64 * 1024 * 1024), metavar="BYTES")
    handshake_timeout: float = opt(5.0, "--handshake-timeout", "drop a TLS client that has "
                                   "not finished its handshake by then",
                                   check=Range(0.1, 300), metavar="SECONDS")
    health_port: int = opt(-1, "--health-port", "plain-HTTP port of /healthz and /readyz "
                           "for the kubelet's probes (on --listen's host), apart from the "
                           "HTTPS port so that no flood there can fail them (the shipped "
                           "Deployment: 9436); 0 picks a free one; -1: none",
                           check=Range(-1, 65535), metavar="PORT")
    own_metrics_port: int = opt(-1, "--metrics-port", "plain-HTTP port of /metrics (the "
                            "reviews by result; every worker's counts), on --listen's host "
                            "(the shipped Deployment: 9435, scraped by its PodMonitor); "
                            "0 picks a free one; -1: none (then /metrics is on the HTTPS "
                            "port only)", check=Range(-1, 65535), metavar="PORT")
    max_connections: int = opt(4096, "--max-connections", "HTTPS connections held at once "
                               "(at most half the process' file descriptors); more are "
                               "answered 503", check=Range(1, 1_000_000), metavar="N")
    max_connections_per_source: int = opt(
        512, "--max-connections-per-source", "HTTPS connections one peer address may hold "
        "(the API server's connections come from few addresses)",
        check=Range(1, 1_000_000), metavar="N")
    workers: int = opt(1, "--workers", "processes serving the port (SO_REUSEPORT; the kernel "
                       "spreads connections): about one per core for large bursts of pods",
                       check=Range(1, 64), metavar="N")
    log_level: str = opt("info", "--log-level", "messages on stderr",
                         choices=("debug", "info", "warning", "error"))
    restart_in_place: str = opt("none", "--restart-in-place", "container restart rules "
                                "added to every arbitrated pod's trainer for the ladder's "
                                "in-place tiers: container (KEP-5307, exit 216: Kubernetes "
                                "1.35+), pod (and KEP-5532 RestartAllContainers, exit 217: "
                                "1.36+), none; a pod's ftagent.io/restart-in-place says its "
                                "own", choices=("none", "container", "pod"))


def build_parser() -> OneLineParser:
    # no abbreviations: the removed --token must not become --token-audience
    parser = OneLineParser(prog=PROG, description=__doc__, epilog=EPILOG,
                           formatter_class=HelpFormatter, allow_abbrev=False)
    add_group(parser, "webhook", WebhookConfig)
    return parser


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> WebhookConfig:
    cfg = resolve_group(build_parser().parse_args(list(argv)), WebhookConfig, environ)
    try:
        split_host_port(cfg.listen)
    except ConfigError:
        raise ConfigError(f"--listen: {cfg.listen!r} is not HOST:PORT") from None
    if cfg.self_signed == bool(cfg.tls_cert or cfg.tls_key):
        raise ConfigError("give --tls-cert and --tls-key, or --self-signed (one of the two)")
    if not cfg.self_signed and not (cfg.tls_cert and cfg.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    return cfg


def tls_files(cfg: WebhookConfig, environ: Mapping[str, str]) -> tuple[str, str]:
    """(cert, key) paths: given, or made now (and shared in-cluster with --webhook-config)."""
    if not cfg.self_signed:
        return cfg.tls_cert, cfg.tls_key
    from ftagent.kube import certs

    ns = cfg.service_namespace or environ.get("POD_NAMESPACE") or "ftagent-system"
    names = certs.service_names(cfg.service, ns)
    if cfg.webhook_config:
        pems = certs.ensure_shared(ns, cfg.tls_secret, cfg.webhook_config, names)
    else:
        pems = certs.self_signed(names + ["localhost"])
    folder = tempfile.mkdtemp(prefix="ftagent-webhook-")
    paths = {}
    for name, data in (("tls.crt", pems.cert), ("tls.key", pems.key)):
        paths[name] = os.path.join(folder, name)
        fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    if cfg.ca_bundle_out:
        with open(cfg.ca_bundle_out, "wb") as f:
            f.write(pems.ca)
    return paths["tls.crt"], paths["tls.key"]


def _server(cfg: WebhookConfig, counters: Counters | None = None) -> WebhookServer:
    from ftagent.kube.inject import Settings
    from ftagent.kube.webhook import CaFile, WebhookServer

    settings = Settings(image=cfg.image, arbiter=cfg.arbiter,
                        arbiter_ca=CaFile(cfg.arbiter_ca) if cfg.arbiter_ca else None,
                        token_audience=cfg.token_audience,
                        image_pull_secrets=tuple(  # repeated, each maybe comma-separated
                            n.strip() for v in cfg.image_pull_secrets for n in v.split(",")
                            if n.strip()),
                        metrics_port=cfg.metrics_port,
                        metrics_port_span=cfg.metrics_port_span,
                        restart_rules="" if cfg.restart_in_place == "none"
                        else cfg.restart_in_place)
    from ftagent.kube.webhook import connection_cap

    return WebhookServer(settings, max_body=cfg.max_body,
                         handshake_timeout=cfg.handshake_timeout,
                         max_connections=connection_cap(cfg.max_connections),
                         max_per_source=cfg.max_connections_per_source, counters=counters)


async def _reload(reloader: CertReloader, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        reloader.check()


async def serve(cfg: WebhookConfig, tls: ssl.SSLContext, *, port: int | None = None,
                ready_fd: int | None = None, reloader: CertReloader | None = None,
                health_port: int | None = None, metrics_port: int | None = None,
                counters: Counters | None = None) -> int:
    """Serve until SIGTERM/SIGINT. ``port`` given: one worker of several on that port
    (and ``health_port``), which says it listens by writing a byte to ``ready_fd`` (-1:
    says nothing; None: on stderr, as a single server does)."""
    from ftagent.kube.webhook import ProbeServer

    server = _server(cfg, counters)
    probes = ProbeServer() if cfg.health_port >= 0 else None
    scrapes = ProbeServer(server.counters) if cfg.own_metrics_port >= 0 else None
    host, listen_port = split_host_port(cfg.listen)
    # Handled before the server announces itself, so a stop sent on "listening on" exits 0.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        bound = await server.start(host, listen_port if port is None else port, tls,
                                   reuse_port=port is not None)
    except OSError as e:
        sys.stderr.write(f"{PROG}: error: cannot listen on {cfg.listen}: "
                         f"{e.strerror or e}\n")
        return 1
    probe_port = -1
    if probes is not None:
        try:
            probe_port = await probes.start(
                host, cfg.health_port if health_port is None else health_port, None,
                reuse_port=health_port is not None)
        except OSError as e:
            sys.stderr.write(f"{PROG}: error: cannot listen on {host}:{cfg.health_port} "
                             f"(--health-port): {e.strerror or e}\n")
            await server.close()
            return 1
    scrape_port = -1
    if scrapes is not None:
        try:
            scrape_port = await scrapes.start(
                host, cfg.own_metrics_port if metrics_port is None else metrics_port, None,
                reuse_port=metrics_port is not None)
        except OSError as e:
            sys.stderr.write(f"{PROG}: error: cannot listen on {host}:"
                             f"{cfg.own_metrics_port} (--metrics-port): {e.strerror or e}\n")
            await server.close()
            if probes is not None:
                await probes.close()
            return 1
    if ready_fd is not None:
        if ready_fd >= 0:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
    else:
        if probes is not None:
            sys.stderr.write(f"probes on http://{host}:{probe_port}/readyz\n")
        if scrapes is not None:
            sys.stderr.write(f"metrics on http://{host}:{scrape_port}/metrics\n")
        sys.stderr.write(f"listening on {host}:{bound}\n")
        sys.stderr.flush()
    watch = asyncio.ensure_future(_reload(reloader, cfg.tls_reload_interval)) \
        if reloader is not None else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await server.close()
    for extra in (probes, scrapes):
        if extra is not None:
            await extra.close()
    return 0


def serve_workers(cfg: WebhookConfig, tls: ssl.SSLContext,
                  reloader: CertReloader | None = None) -> int:
    """``--workers N``: N forked processes, each with its own SO_REUSEPORT socket on one
    port (chosen here, reserved by a bound socket that never listens, so port 0 works).
    A worker that dies is started again; SIGTERM/SIGINT stop them all."""
    host, port = split_host_port(cfg.listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reserve = socket.socket(family, socket.SOCK_STREAM)
    try:
        reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserve.bind((host, port))
    except OSError as e:
        sys.stderr.write(f"{PROG}: error: cannot listen on {cfg.listen}: "
                         f"{e.strerror or e}\n")
        return 1
    port = reserve.getsockname()[1]
    extra: dict[str, socket.socket] = {}  # --health-port, --metrics-port: reserved too
    for flag, wanted in (("--health-port", cfg.health_port),
                         ("--metrics-port", cfg.own_metrics_port)):
        if wanted < 0:
            continue
        extra[flag] = socket.socket(family, socket.SOCK_STREAM)
        try:
            extra[flag].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            extra[flag].bind((host, wanted))
        except OSError as e:
            sys.stderr.write(f"{PROG}: error: cannot listen on {host}:{wanted} "
                             f"({flag}): {e.strerror or e}\n")
            for s in (reserve, *extra.values()):
                s.close()
            return 1
    health_port = extra["--health-port"].getsockname()[1] if "--health-port" in extra else -1
    metrics_port = extra["--metrics-port"].getsockname()[1] if "--metrics-port" in extra \
        else -1
    from ftagent.kube.webhook import Counters

    counters = Counters(workers=cfg.workers)  # shared memory: made before the fork
    rows: dict[int, int] = {}  # pid -> its row in the counters
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    ready_r, ready_w = os.pipe()

    def spawn(row: int, ready: int = -1) -> int:
        pid = os.fork()
        if pid == 0:  # the worker: its own loop, default signal handling
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if ready >= 0:
                os.close(ready_r)
            counters.row = row
            code = 1
            try:
                code = asyncio.run(serve(cfg, tls, port=port, ready_fd=ready,
                                         reloader=reloader, health_port=health_port,
                                         metrics_port=metrics_port, counters=counters))
            finally:
                os._exit(code)
        rows[pid] = row
        return pid

    children: set[int] = set()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    children.update(spawn(row, ready_w) for row in range(cfg.workers))
    os.close(ready_w)
    started = 0
    while started < cfg.workers:  # announce once every worker listens (EOF: one failed)
        got = os.read(ready_r, cfg.workers - started)
        if not got:
            break
        started += len(got)
    os.close(ready_r)
    if started == cfg.workers:
        if health_port >= 0:
            sys.stderr.write(f"probes on http://{host}:{health_port}/readyz\n")
        if metrics_port >= 0:
            sys.stderr.write(f"metrics on http://{host}:{metrics_port}/metrics\n")
        sys.stderr.write(f"listening on {host}:{port}\n")
        sys.stderr.flush()
    else:
        stop(signal.SIGTERM, None)
    code = 0
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        children.discard(pid)
        if not stopping:
            sys.stderr.write(f"{PROG}: warning: worker {pid} ended "
                             f"(status {os.waitstatus_to_exitcode(status)}); starting another\n")
            children.add(spawn(rows.pop(pid, 0)))  # its row: the counts go on
        elif os.waitstatus_to_exitcode(status) not in (0, -signal.SIGTERM):
            code = 1
    for s in (reserve, *extra.values()):
        s.close()
    return code


def main(argv: Sequence[str]) -> int:
    environ = dict(os.environ)
    try:
        cfg = parse(argv, environ)
    except ConfigError as e:
        sys.stderr.write(f"{PROG}: error: {e} (see {PROG} --help)\n")
        return 2
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()),
                        format="[ftagent webhook %(asctime)s] %(levelname)s %(message)s",
                        stream=sys.stderr)
    if cfg.webhook_config and not cfg.self_signed:
        sys.stderr.write(f"{PROG}: warning: --webhook-config is used with --self-signed only\n")
    from ftagent.kube.inject import Settings, clashing_ports

    clash = clashing_ports(Settings(metrics_port=cfg.metrics_port,
                                    metrics_port_span=cfg.metrics_port_span))
    if clash:
        sys.stderr.write(f"{PROG}: warning: --agent-metrics-port {cfg.metrics_port} with span "
                         f"{cfg.metrics_port_span} includes ftagent's own ports {clash[0]}-"
                         f"{clash[-1]} (9400-9439: the node agent's host port 9432): a "
                         "hostNetwork rank given one cannot be scheduled beside the node "
                         "agent; use 9440 (the default)\n")
    try:
        cert, key = tls_files(cfg, environ)
    except Exception as e:  # the cluster refused (RBAC, API down): one line
        sys.stderr.write(f"{PROG}: error: self-signed certificate set-up failed: {e}\n")
        return 1
    from ftagent.kube.webhook import CertReloader, tls_context

    try:
        tls = tls_context(cert, key)
    except (OSError, ssl.SSLError) as e:
        sys.stderr.write(f"{PROG}: error: cannot load --tls-cert/--tls-key: {e}\n")
        return 2
    reloader = None if cfg.self_signed else CertReloader(tls, cert, key)
    if cfg.workers > 1:
        return serve_workers(cfg, tls, reloader)
    return asyncio.run(serve(cfg, tls, reloader=reloader))
