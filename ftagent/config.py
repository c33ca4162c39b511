"""Configuration: one dataclass per part, each field one flag with its FTAGENT_* variable.

The flag tables *are* the dataclasses: ``opt()`` attaches the flag name, the environment
variable, the help text and a value check to a field, and ``build_parser`` turns a group
into an argparse group. So ``--help``, the environment variables and the typed config can
never drift apart. Precedence: flag > FTAGENT_* variable > the field's default (some
identity fields then fall back to the variables torchrun/Kubeflow set, see ``identity``).

A bad flag or value is one line on stderr and exit 2 (``ConfigError``), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A user error in flags or FTAGENT_* variables; printed as one line, exit code 2."""


# --------------------------------------------------------------------------- value checks


def non_negative(v: float) -> float:
    if v < 0:
        raise ConfigError("must be >= 0")
    return v


def positive(v: float) -> float:
    if v <= 0:
        raise ConfigError("must be > 0")
    return v


def port_or_off(v: int) -> int:
    if v < -1 or v > 65535:
        raise ConfigError("must be a port 1-65535, 0 for any free port, or -1 for off")
    return v


def percentile(v: float) -> float:
    if not 0 < v <= 100:
        raise ConfigError("must be in (0, 100]")
    return v


def regex(v: str) -> str:
    try:
        re.compile(v)
    except re.error as e:
        raise ConfigError(f"not a valid regular expression: {e}") from None
    return v


def host_port(v: str) -> str:
    for part in filter(None, (p.strip() for p in v.split(","))):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{part!r} is not HOST:PORT")
    return v


def opt(
    default: Any,
    flag: str,
    help: str,
    *,
    env: str | None = None,
    choices: Sequence[str] | None = None,
    check: Callable[[Any], Any] | None = None,
    metavar: str | None = None,
    sep: str = ",",
) -> Any:
    """A dataclass field that is also a command-line flag and an environment variable."""
    meta = {
        "flag": flag,
        "env": env or "FTAGENT_" + flag.lstrip("-").upper().replace("-", "_"),
        "help": help,
        "choices": choices,
        "check": check,
        "metavar": metavar,
        "sep": sep,
    }
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class SupervisorConfig:
    """How the trainer is run, stopped and restarted locally."""

    max_restarts: int = opt(
        0, "--max-restarts", "restarts allowed after a failure (local policy; the arbiter "
        "counts per job)", check=non_negative, metavar="N")
    restart_backoff: float = opt(
        1.0, "--restart-backoff", "seconds before the first local restart; doubles each "
        "time up to --restart-backoff-max", check=non_negative, metavar="SECONDS")
    restart_backoff_max: float = opt(
        30.0, "--restart-backoff-max", "cap on the local restart backoff",
        check=non_negative, metavar="SECONDS")
    stop_timeout: float = opt(
        30.0, "--stop-timeout", "grace after SIGTERM before every process of the trainer's "
        "tree is SIGKILLed", check=non_negative, metavar="SECONDS")
    events_file: str = opt(
        "", "--events-file", "append one JSON line per event (state, fault, action) to "
        "this file", metavar="PATH")
    log_lines: int = opt(
        200, "--log-lines", "last output lines kept as evidence for faults",
        check=positive, metavar="N")
    log_level: str = opt(
        "info", "--log-level", "ftagent's own messages on stderr",
        choices=("debug", "info", "warning", "error"))


@dataclass(frozen=True)
class IdentityConfig:
    """Who this agent is: labels on metrics, registration with the arbiter."""

    job: str = opt("", "--job", "job name (default: $TORCHELASTIC_RUN_ID, else 'local')")
    namespace: str = opt("", "--namespace", "Kubernetes namespace (default: $POD_NAMESPACE)")
    pod: str = opt("", "--pod", "pod name (default: $POD_NAME, else the hostname)")
    node: str = opt("", "--node", "node name (default: $NODE_NAME, else the hostname)")
    rank: int = opt(
        -1, "--rank", "this agent's rank (default: $RANK, $GROUP_RANK, $PET_NODE_RANK, "
        "else 0)", metavar="N")
    world_size: int = opt(
        -1, "--world-size", "agents in the job; the barrier waits for all of them "
        "(default: $WORLD_SIZE, $PET_NNODES, else 1)", metavar="N")


@dataclass(frozen=True)
class MetricsConfig:
    metrics_port: int = opt(
        9430, "--metrics-port", "Prometheus /metrics port; 0 picks a free port, -1 turns "
        "metrics off", check=port_or_off, metavar="PORT")
    metrics_addr: str = opt("0.0.0.0", "--metrics-addr", "address /metrics listens on",
                            metavar="ADDR")


@dataclass(frozen=True)
class HangConfig:
    """Progress sources and the adaptive hang detector (see detect/hang.py)."""

    progress: str = opt(
        "auto", "--progress", "where step progress comes from: auto (SDK and logs), sdk, "
        "log, or none (crash supervision only: parameter servers, launchers)",
        choices=("auto", "sdk", "log", "none"))
    progress_regex: tuple[str, ...] = opt(
        (), "--progress-regex", "extra log pattern with named groups step, loss, "
        "samples_per_second, tokens_per_second (repeatable; env: newline-separated)",
        check=regex, metavar="REGEX", sep="\n")
    hang_action: str = opt("restart", "--hang-action", "what a detected hang does",
                           choices=("restart", "alert"))
    hang_timeout_min: float = opt(
        5.0, "--hang-timeout-min", "floor of the learned step budget", check=positive,
        metavar="SECONDS")
    hang_factor: float = opt(
        10.0, "--hang-factor", "budget = factor x percentile of recent step intervals "
        "(a phase's: factor x its longest duration seen)", check=positive)
    hang_percentile: float = opt(99.0, "--hang-percentile", "percentile of recent step "
                                 "intervals the budget scales", check=percentile)
    hang_warmup_steps: int = opt(
        5, "--hang-warmup-steps", "steps observed before the learned budget applies; "
        "until then --hang-first-step-timeout holds", check=non_negative, metavar="N")
    hang_first_step_timeout: float = opt(
        600.0, "--hang-first-step-timeout", "budget before the first steps (compilation, "
        "data loading, rendezvous)", check=positive, metavar="SECONDS")
    hang_phase_timeout: float = opt(
        1800.0, "--hang-phase-timeout", "budget for a declared long phase (checkpoint, "
        "eval) until its own duration is learned", check=positive, metavar="SECONDS")
    hang_dump_timeout: float = opt(
        10.0, "--hang-dump-timeout", "deadline for capturing py-spy stacks of the "
        "trainer tree", check=positive, metavar="SECONDS")


@dataclass(frozen=True)
class ArbiterClientConfig:
    """How the agent reaches the arbiter; without --arbiter the local policy decides."""

    arbiter: str = opt(
        "", "--arbiter", "arbiter HOST:PORT; a comma-separated list shards jobs over "
        "replicas by a hash of the job", check=host_port, metavar="HOST:PORT[,...]")
    token: str = opt("", "--token", "shared secret the arbiter requires")
    tls_ca: str = opt("", "--tls-ca", "CA bundle to verify the arbiter (enables TLS)",
                      metavar="PATH")
    tls_cert: str = opt("", "--tls-cert", "client certificate for mTLS", metavar="PATH")
    tls_key: str = opt("", "--tls-key", "client key for mTLS", metavar="PATH")
    arbiter_fail_open_after: float = opt(
        15.0, "--arbiter-fail-open-after", "with the arbiter unreachable this long (at a "
        "start, a barrier, or awaiting a decision) the agent goes on alone: it starts the "
        "trainer and its local policy decides", check=non_negative, metavar="SECONDS")


@dataclass(frozen=True)
class NicConfig:
    """Network links watched through netlink, RDMA ports through sysfs."""

    nic: tuple[str, ...] = opt(
        (), "--nic", "link to watch (repeatable, globs allowed; default: the "
        "NCCL/GLOO socket interfaces, else every non-loopback link up at start)",
        env="FTAGENT_NICS", metavar="NAME")
    nic_grace: float = opt(
        2.0, "--nic-grace", "a link down shorter than this is a flap, not a fault",
        check=non_negative, metavar="SECONDS")
    rdma_sysfs: str = opt("/sys/class/infiniband", "--rdma-sysfs",
                          "root of the RDMA sysfs tree", metavar="PATH")
    nic_poll_interval: float = opt(
        1.0, "--nic-poll-interval", "RDMA port state and NIC counter polling interval",
        check=positive, metavar="SECONDS")
    nic_scope: str = opt(
        "pod", "--nic-scope", "scope of a NIC fault: pod (the pod's own network namespace) "
        "or node (hostNetwork / the node agent: the node's links)", choices=("pod", "node"))


@dataclass(frozen=True)
class RunConfig:
    """Everything ``ftagent run`` needs; ``command`` is what follows ``--``."""

    command: tuple[str, ...]
    supervisor: SupervisorConfig = SupervisorConfig()
    identity: IdentityConfig = IdentityConfig()
    metrics: MetricsConfig = MetricsConfig()
    hang: HangConfig = HangConfig()
    arbiter: ArbiterClientConfig = ArbiterClientConfig()
    nic: NicConfig = NicConfig()


RUN_GROUPS: dict[str, tuple[str, type[Any]]] = {
    "supervisor": ("supervisor", SupervisorConfig),
    "identity": ("identity (labels, arbiter registration)", IdentityConfig),
    "metrics": ("metrics", MetricsConfig),
    "hang": ("progress and hang detection", HangConfig),
    "arbiter": ("arbiter connection", ArbiterClientConfig),
    "nic": ("network links", NicConfig),
}


# --------------------------------------------------------------------------- parsing


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), never the usage block."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _convert(raw: str, typ: Any, meta: Mapping[str, Any], source: str) -> Any:
    """Parse one raw string for a field of type ``typ``; raise ConfigError naming ``source``."""
    try:
        if typ in (int, "int"):
            value: Any = int(raw)
        elif typ in (float, "float"):
            value = float(raw)
        elif typ in (bool, "bool"):
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            value = low in ("1", "true", "yes", "on")
        else:
            value = raw
    except ValueError:
        raise ConfigError(f"{source}: {raw!r} is not a valid {getattr(typ, '__name__', typ)}")\
            from None
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{source}: {raw!r} is not one of {', '.join(meta['choices'])}")
    if meta.get("check"):
        try:
            value = meta["check"](value)
        except ConfigError as e:
            raise ConfigError(f"{source}: {raw!r} {e}") from None
    return value


def _is_multi(typ: Any) -> bool:
    return str(typ).startswith("tuple")


def add_group(parser: argparse.ArgumentParser, title: str, cls: type[Any]) -> None:
    """Add every field of the dataclass ``cls`` as a flag in an argument group."""
    group = parser.add_argument_group(title)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        typ = hints[f.name]
        multi = _is_multi(typ)
        default = f.default
        shown = "" if default in ("", (), -1) else f" (default: {default})"
        kwargs: dict[str, Any] = {
            "dest": f"{cls.__name__}.{f.name}",
            "help": f"{meta['help']}{shown} [env {meta['env']}]",
            "default": None,
        }
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if multi:
            kwargs["action"] = "append"
        elif typ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        group.add_argument(meta["flag"], **kwargs)


def resolve_group(
    ns: argparse.Namespace, cls: type[T], environ: Mapping[str, str]
) -> T:
    """Build the dataclass ``cls`` from parsed flags, then FTAGENT_* variables, then defaults."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        meta = f.metadata
        typ = hints[f.name]
        raw = getattr(ns, f"{cls.__name__}.{f.name}", None)
        if _is_multi(typ):
            if raw is None and meta["env"] in environ:
                raw = [p for p in environ[meta["env"]].split(meta["sep"]) if p.strip()]
                source = meta["env"]
            else:
                source = meta["flag"]
            if raw is not None:
                values[f.name] = tuple(_convert(r, str, meta, source) for r in raw)
            continue
        if raw is None and meta["env"] in environ and environ[meta["env"]] != "":
            values[f.name] = _convert(environ[meta["env"]], typ, meta, meta["env"])
        elif raw is not None:
            if isinstance(raw, bool) or typ is str and meta.get("check") is None:
                values[f.name] = raw
            else:
                values[f.name] = _convert(str(raw), typ, meta, meta["flag"])
    return cls(**values)


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``[options] -- CMD ARGS`` at the first ``--``."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def env_first(environ: Mapping[str, str], *names: str) -> str:
    for n in names:
        if environ.get(n):
            return environ[n]
    return ""


def identity(cfg: IdentityConfig, environ: Mapping[str, str]) -> IdentityConfig:
    """Fill identity fields from the variables torchrun, Kubeflow and the Downward API set."""
    host = env_first(environ, "HOSTNAME") or os.uname().nodename
    rank = cfg.rank
    if rank < 0:
        raw = env_first(environ, "RANK", "GROUP_RANK", "PET_NODE_RANK")
        rank = int(raw) if raw.isdigit() else 0
    world = cfg.world_size
    if world < 0:
        raw = env_first(environ, "WORLD_SIZE", "PET_NNODES")
        world = int(raw) if raw.isdigit() else 1
    return dataclasses.replace(
        cfg,
        job=cfg.job or env_first(environ, "TORCHELASTIC_RUN_ID") or "local",
        namespace=cfg.namespace or env_first(environ, "POD_NAMESPACE"),
        pod=cfg.pod or env_first(environ, "POD_NAME") or host,
        node=cfg.node or env_first(environ, "NODE_NAME") or host,
        rank=rank,
        world_size=max(world, 1),
    )
