"""``ftagent arbiter``: the central process that decides for whole jobs.

It holds no state for decisions: agents re-register after it restarts (``--state-dir``
only keeps the job history ``ftagent status`` shows), so running it is
``ftagent arbiter --listen 0.0.0.0:9400`` with ``FTAGENT_TOKEN=$SECRET`` in a Deployment.
On start it prints ``listening on HOST:PORT`` on stderr (the port actually bound, also for
port 0).

Start-up checks everything it can before it binds anything: the flags, the rule that
beyond loopback someone must authenticate, the TLS files (read and parsed), that the
listen address resolves and can be bound; then it binds /metrics, then the gRPC port
(releasing /metrics if that fails). Every failure is one line on stderr, never a
traceback: exit status 2 for what the flags or files say, 1 for what the system refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.straggler import StragglerAction
from ftagent.config import (
    MAX_SECONDS,
    PORT_OR_OFF,
    POSITIVE_SECONDS,
    RESTARTS,
    SECONDS,
    ConfigError,
    HelpFormatter,
    OneLineParser,
    Range,
    add_group,
    host,
    opt,
    resolve_group,
    split_host_port,
)

if TYPE_CHECKING:
    from ftagent.arbiter.server import ServerSettings

log = logging.getLogger("ftagent.arbiter")

PROG = "ftagent arbiter"

EPILOG = """\
security: beyond loopback (127.0.0.0/8, ::1, localhost) the arbiter refuses to start
  unless peers must authenticate: --token (FTAGENT_TOKEN, better than the flag, which
  shows in ps) or mutual TLS (--tls-client-ca), or --insecure says that anyone who can
  reach the port may speak for any job.

exit status: 0 when stopped by SIGTERM or SIGINT; 2 for a bad flag, value or TLS file,
  or listening beyond loopback without authentication; 1 when the system refuses to
  start it (address in use or not on this host, a name that does not resolve). Each is
  one line on stderr. gRPC's own log is off unless GRPC_VERBOSITY is set (e.g. error).

examples:
  FTAGENT_TOKEN=$SECRET ftagent arbiter                      # 0.0.0.0:9400, metrics on 9431
  ftagent arbiter --listen 127.0.0.1:9400                    # loopback: no token needed
  ftagent arbiter --tls-cert tls.crt --tls-key tls.key --tls-client-ca ca.crt
"""


class StartError(Exception):
    """The system refused to start the arbiter (a port in use, ...): one line, exit 1."""


LEASE_SECONDS = Range(0.1, 3600.0)


def listen_address(v: str) -> str:
    try:
        split_host_port(v)
    except ConfigError:
        raise ConfigError("is not HOST:PORT (port 0 picks a free port)") from None
    return v


@dataclass(frozen=True)
class ArbiterConfig:
    """Flags of ``ftagent arbiter`` (each also an FTAGENT_* variable)."""

    listen: str = opt("0.0.0.0:9400", "--listen", "gRPC address agents and `ftagent status` "
                      "connect to; port 0 picks a free port", check=listen_address,
                      metavar="HOST:PORT")
    max_restarts: int = opt(
        3, "--max-restarts", "restarts allowed per job (all ranks together) before it is "
        "stopped; an agent's own --max-restarts overrides it for its job, up to "
        "--restart-ceiling",
        check=RESTARTS, metavar="N")
    barrier_timeout: float = opt(
        300.0, "--barrier-timeout", "seconds a (re)start waits for every rank to arrive "
        "before the job is stopped, naming the missing ranks", check=POSITIVE_SECONDS,
        metavar="SECONDS")
    nic_replace_after: float = opt(
        300.0, "--nic-replace-after", "a rank whose link stays down this long is replaced "
        "(its pod exits with the replace code)", check=POSITIVE_SECONDS, metavar="SECONDS")
    nic_resume_timeout: float = opt(
        60.0, "--nic-resume-timeout", "after the last link of a job is back, wait up to the "
        "outage's length plus 5 s, at most this long, for every rank's step to advance "
        "(TCP often resumes the collective) before restarting the job; 0: restart at once",
        check=SECONDS, metavar="SECONDS")
    stacks_timeout: float = opt(
        15.0, "--stacks-timeout", "on a job hang, how long to wait for every rank's stacks "
        "before restarting without them", check=POSITIVE_SECONDS, metavar="SECONDS")
    straggler_ratio: float = opt(
        0.8, "--straggler-ratio", "a rank whose own work per step (step time minus its wait "
        "in collectives) runs below this fraction of the other ranks' median speed is slow",
        check=Range(0, 1, lo_open=True), metavar="RATIO")
    straggler_window: float = opt(
        300.0, "--straggler-window", "a rank slow this long is named a straggler (a "
        "warning on the timeline, in status, ftagent_rank_straggler); slow for twice this "
        "long it is persistent", check=POSITIVE_SECONDS, metavar="SECONDS")
    straggler_action: str = opt(
        "alert", "--straggler-action", "what a persistent straggler leads to: alert only, "
        "or replace its pod (spends a restart; never once the budget is spent)",
        choices=tuple(a.value for a in StragglerAction))
    token: str = opt("", "--token", "secret: peers present it (admin) or a job token "
                     "derived from it (`ftagent token --job JOB`)", metavar="SECRET")
    tls_cert: str = opt("", "--tls-cert", "server certificate (enables TLS)", metavar="PATH")
    tls_key: str = opt("", "--tls-key", "server private key", metavar="PATH")
    tls_client_ca: str = opt("", "--tls-client-ca", "CA that agents' client certificates "
                             "must chain to (enables mutual TLS)", metavar="PATH")
    insecure: bool = opt(False, "--insecure", "allow listening beyond loopback without "
                         "authentication (no --token, no --tls-client-ca, no --kube): any "
                         "peer that reaches the port can speak for any job; with --kube, "
                         "allow plaintext gRPC (no TLS), and without --token and "
                         "--tls-client-ca a caller that presents no token at all is the "
                         "ADMIN (every job, every node's reports)")
    previous_token: str = opt(
        "", "--previous-token", "during a secret rotation: the old secret, accepted beside "
        "--token (and the job and node tokens derived from it) until removed",
        metavar="SECRET")
    tls_secret: str = opt("", "--tls-secret", "with --kube: serve TLS with the Secret of "
                          "this name in the arbiter's namespace (tls.crt, tls.key, ca.crt); "
                          "created with a self-signed CA at first start if absent",
                          metavar="NAME")
    tls_reload_interval: float = opt(
        60.0, "--tls-reload-interval", "with --tls-secret: seconds between two reads of the "
        "Secret (a renewed certificate is served from the next connection on); rotated "
        "--tls-cert/--tls-key files are looked at before each new connection",
        check=Range(0.1, 86400), metavar="SECONDS")
    tls_service: str = opt("ftagent-arbiter", "--tls-service", "the Service agents dial: "
                           "the certificate --tls-secret creates is for its DNS names",
                           metavar="NAME")
    token_audience: str = opt("ftagent", "--token-audience", "with --kube: the audience "
                              "of the pods' projected ServiceAccount tokens, checked with a "
                              "TokenReview", metavar="AUDIENCE")
    node_service_account: str = opt(
        "ftagent-node", "--node-service-account", "with --kube: the ServiceAccount (in the "
        "arbiter's namespace) of the node agents; its pod-bound tokens report for their "
        "node only", metavar="NAME")
    allow_legacy_tokens: bool = opt(
        False, "--allow-legacy-tokens", "with --kube: also accept what --token derives that "
        "a leak makes dangerous in a shared cluster: never-expiring ftj1 job tokens "
        "(`ftagent token --ttl 0`) and the every-node (*) node token; without it they are "
        "refused (ftj2 job tokens, one node's token and the secret itself still work)")
    operators: bool = opt(
        False, "--operators", "with --kube: people read jobs (`ftagent status "
        "--kube-credentials`) with their own Kubernetes credentials: the bearer token is "
        "checked with a TokenReview (the API server's audience) and each read with a "
        "SubjectAccessReview (get/list/watch on ftagentjobs.ftagent.io in the job's "
        "namespace); every distinct unknown token then costs one TokenReview, limited per "
        "source address")
    restart_ceiling: int = opt(
        100, "--restart-ceiling", "the most restarts a job's agents may ask for (their "
        "--max-restarts is cut to it)", check=RESTARTS, metavar="N")
    max_ranks_per_job: int = opt(
        100_000, "--max-ranks-per-job", "ranks one job may register (a Hello with a larger "
        "world size is refused)", check=Range(1, 1_000_000), metavar="N")
    max_streams_per_identity: int = opt(
        1024, "--max-streams-per-identity", "agent streams one pod's (or node agent's) "
        "credential may hold open at once; a job token may hold --max-ranks-per-job",
        check=Range(1, 1_000_000), metavar="N")
    metrics_port: int = opt(
        9431, "--metrics-port", "Prometheus /metrics port; 0 picks a free port, -1 turns "
        "metrics off", check=PORT_OR_OFF, metavar="PORT")
    metrics_addr: str = opt("0.0.0.0", "--metrics-addr", "address /metrics listens on",
                            check=host, metavar="ADDR")
    health_port: int = opt(
        -1, "--health-port", "port of /healthz and /readyz for the kubelet's probes, apart "
        "from /metrics so that no flood of scrapes or slow peers there can fail them "
        "(on --metrics-addr; the shipped Deployment: 9433); 0 picks a free port; -1: none "
        "(the probes stay on --metrics-port too)",
        check=PORT_OR_OFF, metavar="PORT")
    leader_label: bool = opt(
        True, "--leader-label", "with --leader-elect and --kube-api/in-cluster: the leader "
        "labels its own pod (POD_NAME, POD_NAMESPACE) ftagent.io/arbiter-leader=true and "
        "removes it when it stands by, so the Service (which selects the label) sends agents "
        "to the leader while every replica is Ready")
    state_dir: str = opt(
        "", "--state-dir", "keep job history (finished jobs' states and timelines) in this "
        "directory across restarts, as bounded JSON lines; empty keeps it in memory only. "
        "Never used for decisions: running jobs are rebuilt from their agents",
        metavar="DIR")
    history_retention: float = opt(
        24 * 3600.0, "--history-retention", "seconds a job stays in `ftagent status` (with "
        "its timeline) after its last agent left", check=POSITIVE_SECONDS, metavar="SECONDS")
    log_level: str = opt("info", "--log-level", "the arbiter's messages on stderr",
                         choices=("debug", "info", "warning", "error"))
    kube_api: str = opt("", "--kube-api", "Kubernetes API server (e.g. http://127.0.0.1:8001 "
                        "behind kubectl proxy); empty: in-cluster config, else --kubeconfig",
                        metavar="URL")
    kubeconfig: str = opt("", "--kubeconfig", "kubeconfig file for the Kubernetes API "
                          "(default: in-cluster, then $KUBECONFIG / ~/.kube/config)",
                          metavar="FILE")
    leader_elect: bool = opt(False, "--leader-elect", "run as one of several replicas: only "
                             "the holder of a coordination.k8s.io Lease serves agents and "
                             "decides; the others are not ready and stand by")
    leader_elect_lease: str = opt("ftagent-arbiter", "--leader-elect-lease", "name of the "
                                  "Lease (one per shard)", metavar="NAME")
    leader_elect_namespace: str = opt(
        "", "--leader-elect-namespace", "namespace of the Lease (default: the pod's, from "
        "POD_NAMESPACE or the service account)", metavar="NS")
    leader_elect_lease_duration: float = opt(
        15.0, "--leader-elect-lease-duration", "seconds a standby waits after the leader's "
        "last renewal before taking over", check=LEASE_SECONDS, metavar="SECONDS")
    leader_elect_renew_deadline: float = opt(
        10.0, "--leader-elect-renew-deadline", "seconds the leader keeps trying to renew "
        "before it stops acting (less than the lease duration)", check=LEASE_SECONDS,
        metavar="SECONDS")
    leader_elect_retry_period: float = opt(
        2.0, "--leader-elect-retry-period", "seconds between tries to acquire or renew",
        check=LEASE_SECONDS, metavar="SECONDS")
    kube: bool = opt(False, "--kube", "act in the cluster: watch ftagent pods (label "
                     "ftagent.io/job) and nodes, turn NotReady nodes and preempted, evicted or "
                     "deleted pods into faults; REPLACE cordons + taints the node and deletes "
                     "the pod; Events on pods and jobs")
    node_notready_grace: float = opt(
        40.0, "--node-notready-grace", "seconds a node may stay NotReady before its ranks "
        "are replaced (with --kube)", check=SECONDS, metavar="SECONDS")
    force_delete_after: float = opt(
        -1.0, "--force-delete-after", "force-delete (grace 0) an ftagent pod stuck "
        "Terminating this long; -1 never (with --kube)",
        check=Range(0, MAX_SECONDS, also=((-1, "never"),)), metavar="SECONDS")
    max_cordon_fraction: float = opt(
        0.1, "--max-cordon-fraction", "circuit breaker: hold at most this fraction (at "
        "least one node) of the nodes a job uses and of the cluster cordoned at once; 0 "
        "never cordons (with --kube)", check=Range(0, 1), metavar="FRACTION")
    max_cordons: int = opt(
        10, "--max-cordons", "circuit breaker: hold at most this many nodes of the "
        "whole cluster cordoned at once on corroborated pod evidence, whatever the fraction "
        "allows (with --kube)",
        check=Range(0, 1_000_000), metavar="N")
    max_confirmed_cordons: int = opt(
        50, "--max-confirmed-cordons", "circuit breaker: hold at most this many nodes "
        "cordoned at once on node evidence (the node's own agent, its NotReady condition); "
        "cordons on corroborated pod evidence count against --max-cordons (with --kube)",
        check=Range(0, 1_000_000), metavar="N")
    uncordon_after: float = opt(
        0.0, "--uncordon-after", "uncordon a node ftagent cordoned once its node agent has "
        "reported it healthy without a break for this long; 0 never (the operator "
        "uncordons: docs/runbooks.md) (with --kube)", check=SECONDS, metavar="SECONDS")
    replacement_pending_grace: float = opt(
        300.0, "--replacement-pending-grace", "seconds a replacement pod may stay Pending "
        "before the timeline and an Event say why it is not scheduled (with --kube)",
        check=POSITIVE_SECONDS, metavar="SECONDS")
    trainjob_status_interval: float = opt(
        30.0, "--trainjob-status-interval", "seconds between two writes of a job's progress "
        "and goodput to its Kubeflow TrainJob's status.trainerStatus; 0 never writes (with "
        "--kube)", check=SECONDS, metavar="SECONDS")
    agent_connect_grace: float = opt(
        120.0, "--agent-connect-grace", "seconds an injected pod may run before its agent "
        "must have connected: after it, ftagent_training_pods_without_agent counts the pod "
        "(reason \"agent not connected\") and the pod gets one Warning Event "
        "FtagentAgentNotRunning (with --kube)", check=POSITIVE_SECONDS, metavar="SECONDS")
    history_namespace: str = opt(
        "", "--history-namespace", "keep job history in Kubernetes, one bounded ConfigMap "
        "per job (ftagent-job.NS.JOB.HASH) in this namespace, read back when leading; the "
        "cluster's --state-dir", metavar="NS")

    def settings(self) -> ServerSettings:
        from ftagent.arbiter.server import ServerSettings

        return ServerSettings(
            listen=self.listen, token=self.token, previous_token=self.previous_token,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key, tls_client_ca=self.tls_client_ca,
            metrics_port=self.metrics_port, metrics_addr=self.metrics_addr,
            insecure=self.insecure, state_dir=self.state_dir,
            history_retention=self.history_retention, leader_elect=self.leader_elect,
            kube_identity=self.kube,
            restart_ceiling=self.restart_ceiling, max_ranks_per_job=self.max_ranks_per_job,
            max_streams_per_identity=self.max_streams_per_identity,
            policy=PolicyConfig(max_restarts=self.max_restarts,
                                barrier_timeout=self.barrier_timeout,
                                nic_replace_after=self.nic_replace_after,
                                nic_resume_timeout=self.nic_resume_timeout,
                                stacks_timeout=self.stacks_timeout,
                                straggler_ratio=self.straggler_ratio,
                                straggler_window=self.straggler_window,
                                straggler_action=StragglerAction(self.straggler_action)))


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG,
                           formatter_class=HelpFormatter)
    add_group(parser, "arbiter", ArbiterConfig)
    return parser



def parse(argv: list[str], environ: Mapping[str, str] | None = None) -> ArbiterConfig:
    ns = build_parser().parse_args(argv)
    return resolve_group(ns, ArbiterConfig, os.environ if environ is None else environ)


# --------------------------------------------------------------------------- pre-flight


def check_authority(cfg: ArbiterConfig) -> None:
    """Beyond loopback, peers must authenticate unless --insecure says otherwise (the rule
    of ``auth``, which the server applies again; here it is one line and exit 2)."""
    from ftagent.arbiter.auth import has_credentials, listens_on_loopback

    if cfg.kube and not (cfg.insecure or cfg.tls_cert or cfg.tls_secret
                         or listens_on_loopback(cfg.listen)):
        raise ConfigError(f"refusing plaintext gRPC on {cfg.listen} with --kube: agents "
                          "send their tokens over it. Set --tls-secret ftagent-arbiter-tls "
                          "(FTAGENT_TLS_SECRET) or --tls-cert/--tls-key, or pass --insecure")
    if cfg.tls_secret and not cfg.kube:
        raise ConfigError("--tls-secret reads a Kubernetes Secret: it needs --kube")
    if cfg.tls_secret and (cfg.tls_cert or cfg.tls_key):
        raise ConfigError("--tls-secret and --tls-cert/--tls-key are two sources of one "
                          "certificate: give one")
    if cfg.insecure or cfg.kube or has_credentials(cfg.token, cfg.tls_client_ca) \
            or listens_on_loopback(cfg.listen):
        return
    _, port = split_host_port(cfg.listen)
    raise ConfigError(f"refusing to listen on {cfg.listen} without authentication: set "
                      f"--token (FTAGENT_TOKEN) or --tls-client-ca, or --listen "
                      f"127.0.0.1:{port}, or --insecure")


def tokenless_admin(cfg: ArbiterConfig) -> str:
    """The start-up line saying that, with --kube, a caller without a token is the admin
    (no --token, no --tls-client-ca: --insecure, or loopback); "" when none is."""
    from ftagent.arbiter.auth import listens_on_loopback

    if not cfg.kube or cfg.token or cfg.tls_client_ca:
        return ""
    if cfg.insecure:
        return (f"--kube --insecure without --token: a caller on {cfg.listen} that presents "
                "no token at all is the ADMIN (every job, every node's reports); pods' "
                "tokens are still checked")
    if listens_on_loopback(cfg.listen):
        return (f"--kube on loopback ({cfg.listen}) without --token: a local caller that "
                "presents no token is the admin")
    return ""


def unauthenticated_beyond_loopback(cfg: ArbiterConfig) -> bool:
    from ftagent.arbiter.auth import has_credentials, listens_on_loopback

    return not cfg.kube and not has_credentials(cfg.token, cfg.tls_client_ca) \
        and not listens_on_loopback(cfg.listen)


def _no_password(*_: Any) -> bytes:
    raise ConfigError("is encrypted; give an unencrypted key (as in a Kubernetes TLS "
                      "Secret's tls.key)")


def _pem(path: str, flag: str, marker: bytes, what: str) -> None:
    from ftagent.wire.credentials import read_file

    try:
        data = read_file(path, flag)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if marker not in data:
        raise ConfigError(f"{flag} {path}: no PEM {what} in it")


def check_tls(cfg: ArbiterConfig) -> None:
    """Read the TLS files as the server will and parse them, so that a missing, unreadable
    or garbled file, or a key that does not belong to the certificate, is an error now,
    not at the first handshake."""
    from ftagent.arbiter.auth import server_credentials

    try:
        server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not cfg.tls_cert:
        return
    _pem(cfg.tls_cert, "--tls-cert", b"-----BEGIN CERTIFICATE-----", "certificate")
    _pem(cfg.tls_key, "--tls-key", b"PRIVATE KEY-----", "private key")
    if cfg.tls_client_ca:
        _pem(cfg.tls_client_ca, "--tls-client-ca", b"-----BEGIN CERTIFICATE-----",
             "CA certificate")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with contextlib.suppress(ssl.SSLError):
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # judge the files, not the key sizes
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key, password=_no_password)
    except ConfigError as e:
        raise ConfigError(f"--tls-key {cfg.tls_key} {e}") from None
    except ssl.SSLError as e:
        why = ("the key does not belong to the certificate"
               if e.reason == "KEY_VALUES_MISMATCH" else f"cannot be loaded ({e.reason or e})")
        raise ConfigError(f"--tls-cert {cfg.tls_cert} with --tls-key {cfg.tls_key}: "
                          f"{why}") from None
    except OSError as e:
        raise ConfigError(f"--tls-cert {cfg.tls_cert}: {e.strerror or e}") from None
    if cfg.tls_client_ca:
        try:
            ctx.load_verify_locations(cafile=cfg.tls_client_ca)
        except (ssl.SSLError, OSError) as e:
            reason = e.reason if isinstance(e, ssl.SSLError) else e.strerror
            raise ConfigError(f"--tls-client-ca {cfg.tls_client_ca}: cannot be loaded "
                              f"({reason or e})") from None


_HINTS = {
    errno.EADDRINUSE: "is another arbiter running? pick another port with --listen",
    errno.EADDRNOTAVAIL: "not an address of this host",
    errno.EACCES: "ports below 1024 need privileges",
}


def _why(e: OSError) -> str:
    hint = _HINTS.get(e.errno or 0)
    return f"{e.strerror or e}" + (f" ({hint})" if hint else "")


def check_bindable(listen: str, flag: str = "--listen") -> None:
    """Resolve ``listen`` and bind (then release) each of its addresses as gRPC will, so
    that a port in use is named precisely before anything is started."""
    host, port = split_host_port(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise StartError(f"cannot listen on {listen}: {host!r} does not resolve "
                         f"({getattr(e, 'strerror', None) or e}; {flag})") from None
    errors: list[OSError] = []
    bound = 0
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(addr)
        except OSError as e:
            errors.append(e)
        else:
            bound += 1
    in_use = [e for e in errors if e.errno == errno.EADDRINUSE]
    if in_use or not bound:
        raise StartError(f"cannot listen on {listen}: {_why((in_use or errors)[0])}")


# --------------------------------------------------------------------------- start


def _http_app(registry: Any, ready: Callable[[], bool]) -> Any:
    """/metrics, plus /healthz (alive: 200) and /readyz (200 once able to serve agents, on
    a standby too: the Service's leader label, not readiness, picks the leader). The same
    probes are on their own port (--health-port): the shipped probes use that one."""
    from prometheus_client import make_wsgi_app

    from ftagent.metrics_http import probe_app

    metrics = make_wsgi_app(registry)
    probes = probe_app(ready, "not ready: not serving yet")

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO", "") in ("/healthz", "/readyz", "/livez"):
            return probes(environ, start_response)
        return metrics(environ, start_response)

    return app


def _serve_http(port: int, addr: str, app: Any) -> Any:
    """A threaded WSGI server with our app and a bounded number of connections."""
    from ftagent import metrics_http

    return metrics_http.serve(port, addr, app)


def start_metrics(cfg: ArbiterConfig, registry: Any,
                  ready: Callable[[], bool] = lambda: True) -> Any:
    """Serve /metrics from ``registry`` (and /healthz, /readyz); returns the HTTP server
    (None when off)."""
    if cfg.metrics_port < 0:
        return None
    try:
        httpd = _serve_http(cfg.metrics_port, cfg.metrics_addr,
                            _http_app(registry, ready))
    except (OSError, UnicodeError) as e:
        why = _why(e) if isinstance(e, OSError) else str(e)
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            why = f"{e.strerror} (pick another with --metrics-port, or -1 for none)"
        raise StartError(f"cannot serve metrics on {cfg.metrics_addr}:{cfg.metrics_port}: "
                         f"{why}") from None
    return httpd


def start_health(cfg: ArbiterConfig, ready: Callable[[], bool]) -> Any:
    """Serve /healthz and /readyz on --health-port (None when off)."""
    if cfg.health_port < 0:
        return None
    from ftagent import metrics_http

    try:
        return metrics_http.serve_health(cfg.health_port, cfg.metrics_addr, ready,
                                         not_ready="not ready: not serving yet")
    except (OSError, UnicodeError) as e:
        why = _why(e) if isinstance(e, OSError) else str(e)
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            why = f"{e.strerror} (pick another with --health-port, or -1 for none)"
        raise StartError(f"cannot serve probes on {cfg.metrics_addr}:{cfg.health_port}: "
                         f"{why}") from None


def _close(httpd: Any) -> None:
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()


async def run(cfg: ArbiterConfig) -> int:
    """Pre-flight, bind /metrics, bind gRPC, serve until SIGTERM/SIGINT; raises
    ConfigError (exit 2) or StartError (exit 1) for the caller to print."""
    check_authority(cfg)
    check_tls(cfg)
    check_bindable(cfg.listen)
    election = election_config(cfg)  # ConfigError for durations that cannot elect safely

    from ftagent.arbiter.server import ArbiterServer, serve_until

    kube = kube_client(cfg) if cfg.leader_elect or cfg.history_namespace or cfg.kube \
        else None
    store = None
    if cfg.history_namespace:
        from ftagent.kube.job_record import ConfigMaps, JobRecords

        store = JobRecords(ConfigMaps(kube, cfg.history_namespace))

    authenticator = None
    if cfg.kube:
        authenticator = kube_authenticator(cfg, kube)
    if cfg.tls_secret:
        cfg = tls_from_secret(cfg, kube)

    # /metrics is served here rather than by ArbiterServer.start(), so that it is bound
    # before the gRPC port and released if that fails (start() binds it after gRPC).
    try:
        server = ArbiterServer(dataclasses.replace(cfg.settings(), metrics_port=-1),
                               authenticator=authenticator, history_store=store)
    except OSError as e:  # --state-dir cannot be created, read or written
        raise StartError(f"cannot keep history in --state-dir {cfg.state_dir}: "
                         f"{e.strerror or e}") from None
    if cfg.kube and cfg.operators:
        attach_operators(server, kube)
    httpd = start_metrics(cfg, server.prom, lambda: server.serving)
    try:
        probes = start_health(cfg, lambda: server.serving)
    except StartError:
        _close(httpd)
        raise
    elector = label = None
    # SIGTERM/SIGINT are handled before "listening on" is printed: whoever starts the
    # arbiter may stop it as soon as it reads that line, and must get a clean exit 0.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if cfg.kube:  # first: the pod list is under way (and Hellos can wait for it) when
            attach_cluster(cfg, server, kube)  # the first agent reaches the port
        try:
            address = await server.start()
        except ValueError as e:  # what the pre-flight checks should have caught
            raise ConfigError(str(e)) from None
        except (OSError, RuntimeError) as e:
            raise StartError(str(e) if isinstance(e, OSError) else
                             f"cannot listen on {cfg.listen}: {e}") from None
        sys.stderr.write(f"listening on {address}\n")
        if httpd is not None:
            sys.stderr.write(f"metrics on http://{cfg.metrics_addr}:{httpd.server_port}"
                             "/metrics\n")
        if probes is not None:
            sys.stderr.write(f"probes on http://{cfg.metrics_addr}:{probes.server_port}"
                             "/readyz\n")
        sys.stderr.flush()
        if unauthenticated_beyond_loopback(cfg):
            log.warning("listening on %s without authentication (--insecure): any peer "
                        "can speak for any job", address)
        warning = tokenless_admin(cfg)
        if warning:
            log.warning("%s", warning)
        if election is not None:
            from ftagent.kube.lease import LeaderElector, LeaseApi

            label = leader_label(cfg, kube, election.namespace)
            elector = LeaderElector(LeaseApi(kube, election), election, loop,
                                    *leadership(server, label, loop))
            elector.start()
        await serve_until(server, stop)
    finally:
        if elector is not None:  # after the server stopped acting: hand the Lease over
            await asyncio.get_running_loop().run_in_executor(None, elector.stop)
        if label is not None:  # not the leader any more: off the Service's endpoints
            await asyncio.get_running_loop().run_in_executor(None, label.stand_by)
        _close(httpd)
        _close(probes)
    return 0


def leader_label(cfg: ArbiterConfig, kube: Any, namespace: str) -> Any:
    """The LeaderLabel of this replica's pod (None without --leader-label or POD_NAME);
    clears a label a previous container of this pod left."""
    pod = os.environ.get("POD_NAME", "")
    if not cfg.leader_label or not pod:
        if cfg.leader_label:
            log.warning("--leader-label: no POD_NAME in the environment (the downward API); "
                        "the leader does not label its pod")
        return None
    from ftagent.kube.leader_label import LeaderLabel

    label = LeaderLabel(kube, namespace, pod)
    label.stand_by()
    return label


def leadership(server: Any, label: Any, loop: asyncio.AbstractEventLoop
               ) -> tuple[Callable[[], Any], Callable[..., Any]]:
    """The elector's two transitions: lead (then take the Service's label), stand by
    (first stop acting, then give the label up)."""
    def lead() -> Any:
        async def go() -> None:
            await server.lead()
            if label is not None and server.leading:
                await loop.run_in_executor(None, label.lead)
        return asyncio.ensure_future(go())

    def stand_by(*args: Any, **kwargs: Any) -> None:
        server.step_down(*args, **kwargs)
        if label is not None:
            loop.run_in_executor(None, label.stand_by)

    return lead, stand_by


def election_config(cfg: ArbiterConfig) -> Any:
    """The Lease settings (None without --leader-elect); ConfigError when unsafe."""
    if not cfg.leader_elect:
        return None
    from ftagent.kube.lease import ElectionConfig, identity

    e = ElectionConfig(name=cfg.leader_elect_lease,
                       namespace=cfg.leader_elect_namespace or pod_namespace(),
                       identity=identity(), lease_duration=cfg.leader_elect_lease_duration,
                       renew_deadline=cfg.leader_elect_renew_deadline,
                       retry_period=cfg.leader_elect_retry_period)
    problem = e.problem()
    if problem:
        raise ConfigError(problem)
    return e


SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def pod_namespace() -> str:
    """The pod's namespace: POD_NAMESPACE (downward API), the service account's, else
    "default" (as client-go's in-cluster namespace)."""
    ns = os.environ.get("POD_NAMESPACE", "")
    if not ns:
        with contextlib.suppress(OSError), open(SA_NAMESPACE) as f:
            ns = f.read(256).strip()
    return ns or "default"


_TASKS: set[asyncio.Task[Any]] = set()  # started here, referenced until done


def attach_cluster(cfg: ArbiterConfig, server: Any, kube: Any) -> Any:
    """--kube: plug kube.cluster.Cluster into the server's registry, start the pod and
    node watches (threads) and the cluster's ticker (a task on this loop)."""

    from ftagent.kube.cluster import Cluster, start_watches, tick_forever

    cluster = Cluster(server.registry, kube, kube_settings(cfg))
    cluster.active = lambda: bool(server.leading)
    server.pod_lookup = cluster.pod_facts
    server.on_node_report.append(cluster.node_reported)
    server.on_node_health.append(cluster.node_health)
    cluster.on_cordon = lambda node, kind: server.metrics.cordons.labels(
        node=node[:253], kind=kind[:64]).inc()  # prometheus_client counters: thread-safe
    cluster.on_action_failed = lambda action: server.metrics.actions_failed.labels(
        action=action).inc()
    cluster.on_cordon_skipped = server.metrics.cordons_skipped.inc
    projected = _projected(server.guard.authenticator)
    loop = asyncio.get_running_loop()
    if projected is not None:  # tokens verified locally: checked against this watch
        projected.pod_uid = lambda ns, pod: cluster._uid(ns, pod) or None
        cluster.on_pod_deleted = projected.pod_deleted
        # the issuer's keys read now, beside the pod list, not by the first agent's call
        prefetch = loop.create_task(projected.keys.refresh())
        _TASKS.add(prefetch)
        prefetch.add_done_callback(_TASKS.discard)
    cluster.on_uncordon = lambda node: server.metrics.uncordons.labels(node=node[:253]).inc()
    server.metrics.cordons_held.set_function(lambda: cluster.breaker.count())
    server.on_registry.append(cluster.rebind)  # each term as leader has its own registry
    watches = start_watches(cluster, kube, loop, threading.Event())
    server.pods_synced = watches[0].informer.until_synced  # the pod informer
    from ftagent.kube.skipped import start_announcing  # their Events (one per pod)
    from ftagent.kube.uninjected import watch_uninjected  # pods injection missed (gauge)

    def record(*args: Any) -> None:  # an Event on the pod, written in the background
        cluster.recorder.record(*args)
        cluster._flush_events()

    watch_uninjected(kube, loop, server.prom, connected=lambda: {
        (j.namespace, r.pod) for j in list(cluster.registry.jobs.values())
        for r in list(j.ranks.values()) if r.connected} if server.leading else None,
        announce=start_announcing(loop, record, cfg.agent_connect_grace),
        grace=cfg.agent_connect_grace)
    cluster.ticker = loop.create_task(tick_forever(cluster))
    return cluster


def attach_operators(server: Any, kube: Any) -> Any:
    """--operators: an operator's read is granted what SubjectAccessReview allows."""
    from ftagent.arbiter.operators import OperatorAccess
    from ftagent.kube.tokenreview import access_reviewer

    access = OperatorAccess(access_reviewer(kube))
    access.namespaces = lambda: {j.namespace for j in server.registry.listing()}
    server.guard.access = access
    return access


def _projected(authenticator: Any) -> Any:
    """The chain's ProjectedTokens (kube/projected.py), if it has one."""
    return next((a for a in getattr(authenticator, "authenticators", ())
                 if type(a).__name__ == "ProjectedTokens"), None)


def kube_settings(cfg: ArbiterConfig) -> Any:
    """What the --kube flags say, for kube.cluster.Cluster (a KubeSettings)."""
    from ftagent.kube.cluster import KubeSettings

    return KubeSettings(
        node_notready_grace=cfg.node_notready_grace,
        force_delete_after=cfg.force_delete_after,
        max_cordon_fraction=cfg.max_cordon_fraction, max_cordons=cfg.max_cordons,
        max_confirmed_cordons=cfg.max_confirmed_cordons, uncordon_after=cfg.uncordon_after,
        pending_grace=cfg.replacement_pending_grace,
        trainjob_status_interval=cfg.trainjob_status_interval)


def kube_authenticator(cfg: ArbiterConfig, kube: Any) -> Any:
    """--kube: pods' projected ServiceAccount tokens (verified locally against the
    issuer's published keys, TokenReview where those cannot be read) beside what --token
    and --tls-client-ca allow; callers without any token are the admin only without
    either, and only on loopback or with --insecure (a token refused never falls through)."""
    from ftagent.arbiter import auth
    from ftagent.kube.tokenreview import reviewer

    chain: list[Any] = []
    if cfg.token:
        both = (cfg.token, cfg.previous_token)
        legacy = cfg.allow_legacy_tokens
        chain += [auth.JobTokens(both, unexpiring=legacy),
                  auth.NodeTokens(both, every_node=legacy), auth.Secret(both)]
    reviews = auth.TokenReviews(reviewer(kube, cfg.token_audience),
                                audience=cfg.token_audience, node_namespace=pod_namespace(),
                                node_account=cfg.node_service_account)
    try:
        import jwt  # noqa: F401  (PyJWT, the arbiter extra: local verification)

        from ftagent.kube.projected import IssuerKeys, ProjectedTokens
    except ImportError:
        log.warning("PyJWT is not installed (pip install 'ftagent[arbiter]'): every pod token "
                    "is checked with a TokenReview instead of locally")
        chain.append(reviews)
    else:
        chain.append(ProjectedTokens(IssuerKeys(kube), reviews, audience=cfg.token_audience,
                                     node_namespace=pod_namespace(),
                                     node_account=cfg.node_service_account))
    if cfg.operators:  # after the pods' own path: only what is no pod's token gets here
        from ftagent.arbiter.operators import operator_of

        chain.append(auth.TokenReviews(reviewer(kube, ""), to_principal=operator_of))
    if cfg.tls_client_ca and not cfg.token:
        chain.append(auth.ClientCertificate())
    elif not cfg.token and not cfg.tls_client_ca and (
            cfg.insecure or auth.listens_on_loopback(cfg.listen)):
        chain.append(auth.Anyone(tokenless=True))
    return auth.Chain(chain)


def tls_from_secret(cfg: ArbiterConfig, kube: Any) -> ArbiterConfig:
    """--tls-secret: read (or create) the Secret, write its certificate and key to a
    private temporary directory, and serve them as --tls-cert/--tls-key."""
    import tempfile
    from pathlib import Path

    from ftagent.kube.certs import ensure_secret, service_names

    namespace = pod_namespace()
    try:
        # localhost too: an operator's `kubectl port-forward` then `ftagent status --arbiter
        # localhost:9400` (docs/runbooks.md); only this install's CA signs it
        pems, created = ensure_secret(kube, namespace, cfg.tls_secret,
                                      [*service_names(cfg.tls_service, namespace), "localhost"])
    except Exception as e:
        raise StartError(f"--tls-secret {namespace}/{cfg.tls_secret}: {e}") from None
    if created:
        log.warning("created Secret %s/%s with a self-signed CA for the Service %s (agents "
                    "verify with its ca.crt)", namespace, cfg.tls_secret, cfg.tls_service)
    d = Path(tempfile.mkdtemp(prefix="ftagent-arbiter-tls-"))
    write_pair(d, pems.cert, pems.key)
    follow_tls_secret(kube, namespace, cfg.tls_secret, d, cfg.tls_reload_interval)
    return dataclasses.replace(cfg, tls_cert=str(d / "tls.crt"), tls_key=str(d / "tls.key"))


def write_pair(d: Any, cert: bytes, key: bytes) -> None:
    """Write tls.crt and tls.key into ``d``, each replaced at once (a reader sees the old
    or the new file, never half of one); the key readable by this user only."""
    for name, data, mode in (("tls.key", key, 0o600), ("tls.crt", cert, 0o644)):
        tmp = d / f".{name}.new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, d / name)


def follow_tls_secret(kube: Any, namespace: str, name: str, d: Any,
                      interval: float) -> None:
    """Re-read the Secret every ``interval`` seconds (cert-manager renews it in place) and
    rewrite the files when it changed: the gRPC credentials serve them from the next
    handshake (wire/tls_files.py). A daemon thread; API errors are one log line each."""

    from kubernetes import client

    from ftagent.kube.certs import from_secret_data

    core = client.CoreV1Api(kube)

    def loop() -> None:
        last = ((d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes())
        while True:
            time.sleep(interval)  # a period between reads, not a synchronization
            try:
                found = core.read_namespaced_secret(name, namespace, _request_timeout=10)
                pems = from_secret_data(found.data or {})
            except Exception as e:
                log.warning("--tls-secret %s/%s: cannot re-read it (%s)", namespace, name,
                            type(e).__name__)
                continue
            if pems is not None and (pems.cert, pems.key) != last:
                write_pair(d, pems.cert, pems.key)
                last = (pems.cert, pems.key)
                log.info("--tls-secret %s/%s changed: serving its new certificate",
                         namespace, name)

    threading.Thread(target=loop, name="tls-secret", daemon=True).start()


def kube_client(cfg: ArbiterConfig) -> Any:
    """A ``kubernetes`` ApiClient (ftagent/kube/client.py): --kube-api URL, else
    in-cluster, else --kubeconfig."""
    try:
        from ftagent.kube.client import KubeConfigError, api_client
    except ImportError:
        raise StartError("--kube, --leader-elect and --history-namespace need the kubernetes "
                         "client: pip install 'ftagent[arbiter]'") from None
    try:
        return api_client(cfg.kube_api or None, kubeconfig=cfg.kubeconfig or None)
    except KubeConfigError as e:
        raise StartError(f"no Kubernetes API: {e}") from None


# CPython's defaults are (700, 10, 10). See collect_rarely.
GC_THRESHOLDS = (50_000, 20, 10)


def collect_rarely() -> None:
    """Run the cyclic garbage collector about 70 times less often than CPython's default.

    The arbiter's heap is large and long-lived (every rank's state, every watched pod:
    about 450 MB at 10,000 agents), and reference counting frees almost all of its garbage.
    With the default thresholds, 10,000 agents reconnecting after a failover triggered about
    1,550 young, 140 middle and 11 full collections. The full ones took 4.1 s of the new
    arbiter's CPU and stopped its event loop for up to 0.9 s each. That pause was the
    800-1,000 ms outliers in fault -> RESTART p99 in ``bench/arbiter_scale.py``. With
    these thresholds the same failover runs 22 young collections, one middle and no full
    one (1.0 s in all). A full collection still runs after about 10 million net
    allocations, so garbage in cycles is still reclaimed."""
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: list[str]) -> int:
    # gRPC's C core logs to stderr on its own (a failed bind is an "E1201 add_port.cc"
    # line); the errors that matter are ours, one line each. Must precede importing grpc.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        cfg = parse(argv)
    except ConfigError as e:
        sys.stderr.write(f"{PROG}: error: {e} (see {PROG} --help)\n")
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    collect_rarely()
    try:
        return end_process(asyncio.run(run(cfg)))
    except ConfigError as e:
        sys.stderr.write(f"{PROG}: error: {e} (see {PROG} --help)\n")
        return end_process(2)
    except StartError as e:  # with --kube, after its threads started (a --tls-secret's)
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return end_process(1)


def end_process(rc: int) -> int:
    """Exit with ``rc`` now, without the interpreter's finalization, when daemon threads
    are still alive (``main`` is the process's: ``ftagent arbiter``).

    With --kube, threads of ours and of the ``kubernetes`` client may be inside an API
    call when SIGTERM stops the arbiter (an informer's watch read, an Event, the lease).
    Finalization ends a daemon thread that wakes from such a call with pthread_exit, whose
    forced unwind aborts the process when the stack holds frames that cannot be unwound:
    the ``kubernetes`` client's methods run inside pydantic-core's (Rust) ``validate_call``.
    That was a SIGABRT (exit -6) after a clean stop. Everything the arbiter keeps (history,
    the lease, the leader label, the servers) was closed by ``run`` before this; only the
    standard streams and the log handlers are left to flush."""
    if threading.current_thread() is not threading.main_thread() or not any(
            t.daemon and t.is_alive() for t in threading.enumerate()):
        return rc
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)

