"""Configuration: one dataclass per part, each field one flag with its FTAGENT_* variable.

The flag tables *are* the dataclasses: ``opt()`` attaches the flag name, the environment
variable, the help text and a value check to a field, and ``build_parser`` turns a group
into an argparse group. So ``--help``, the environment variables and the typed config can
never drift apart. Precedence: flag > FTAGENT_* variable > the field's default (some
identity fields then fall back to the variables torchrun/Kubeflow set, see ``identity``).

Every number has a range (a ``Range`` check, required of every int and float field):
NaN and infinities are never accepted, and the bounds stay far from what would overflow
a timer, an int32 field or a loop. The limits shared with the wire come from
``ftagent.wire.limits``. A bad flag or value is one line on stderr and exit 2
(``ConfigError``), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, get_type_hints

from ftagent.model import EXIT_REPLACE, EXIT_STOP
from ftagent.wire.limits import (
    MAX_GPUS,
    MAX_NAME,
    MAX_RESTARTS,
    MAX_WORLD_SIZE,
    OutOfRange,
    check_name,
)

T = TypeVar("T")

# Seconds: ~31 years, far below what overflows a timer (threading.TIMEOUT_MAX is ~9.2e9 s;
# monotonic deadlines stay exact in a float).
MAX_SECONDS = 1e9
# A count that must fit a signed 32-bit field (the wire's, and most libraries' ints).
MAX_COUNT = 2**31 - 1
# Last output lines kept as evidence (each up to 64 KiB: memory stays bounded).
MAX_LOG_LINES = 100_000


class ConfigError(ValueError):
    """A user error in flags or FTAGENT_* variables; printed as one line, exit code 2."""


# --------------------------------------------------------------------------- value checks


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def shown(raw: str, limit: int = 40) -> str:
    """``raw`` quoted for an error message, cut when long (a 4,400-digit number is one
    short line, not a screenful)."""
    if len(raw) <= limit:
        return repr(raw)
    return f"{raw[:limit]!r}... ({len(raw)} characters)"


@dataclass(frozen=True)
class Range:
    """The values a numeric flag accepts: ``lo``..``hi`` (``lo`` excluded when
    ``lo_open``), plus sentinel values outside it (``also``: -1 for "off" or "unset").
    Every int and float flag has one; NaN and infinities never pass."""

    lo: float
    hi: float
    lo_open: bool = False
    also: tuple[tuple[int, str], ...] = ()

    def __call__(self, v: float) -> float:
        if any(v == special for special, _ in self.also):
            return v
        if isinstance(v, float) and not math.isfinite(v):  # an int may exceed a float
            raise ConfigError("is not a finite number")
        if v < self.lo or v == self.lo and self.lo_open or v > self.hi:
            raise ConfigError(f"must be {self.describe()}")
        return v

    def describe(self) -> str:
        text = f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}]"
        text = "in " + text
        for special, label in self.also:
            text += f", or {special} ({label})"
        return text


SECONDS = Range(0, MAX_SECONDS)
POSITIVE_SECONDS = Range(0, MAX_SECONDS, lo_open=True)
PORT_OR_OFF = Range(0, 65535, also=((-1, "off"),))
PERCENTILE = Range(0, 100, lo_open=True)
RESTARTS = Range(0, MAX_RESTARTS)


def regex(v: str) -> str:
    try:
        re.compile(v)
    except (re.error, RecursionError, OverflowError) as e:
        raise ConfigError(f"not a valid regular expression: {e}") from None
    return v


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)


def modules(v: str) -> str:
    """Comma-separated dotted module names (``torch,transformers.models``)."""
    for part in v.split(","):
        if part.strip() and (len(part.strip()) > 200
                             or not _MODULE_NAME.fullmatch(part.strip())):
            raise ConfigError(f"has {shown(part.strip())}, which is not a module name")
    return v


_GPU_ID = re.compile(r"(?:GPU|MIG)-[0-9A-Za-z/-]{1,59}|\d{1,4}", re.ASCII)


def _gpu_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def gpu_ids(v: str) -> str:
    """Comma-separated GPU ids as the device plugin names them: UUIDs (``GPU-...``,
    ``MIG-...``) or the node's GPU indices; at most MAX_GPUS."""
    parts = _gpu_list(v)
    if len(parts) > MAX_GPUS:
        raise ConfigError(f"names {len(parts)} GPUs; at most {MAX_GPUS}")
    for part in parts:
        if not _GPU_ID.fullmatch(part):
            raise ConfigError(f"has {shown(part)}, which is neither a GPU UUID (GPU-..., "
                              "MIG-...) nor a GPU index")
    return v


def visible_gpu_ids(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs the NVIDIA device plugin gave this container ($NVIDIA_VISIBLE_DEVICES:
    UUIDs by default, indices with deviceIDStrategy=index); () for all, none, void, unset
    or anything else, which say nothing about which GPUs. Without it, the Ascend NPUs the
    Ascend Docker Runtime mounted ($ASCEND_VISIBLE_DEVICES: the node's NPU ids, ranges
    such as 0-3 allowed), as indices: what a node agent's NPU fault names."""
    parts = tuple(_gpu_list(environ.get("NVIDIA_VISIBLE_DEVICES", "")))
    if not parts:
        parts = tuple(_npu_ids(environ.get("ASCEND_VISIBLE_DEVICES", "")))
    if not parts or len(parts) > MAX_GPUS or not all(_GPU_ID.fullmatch(p) for p in parts):
        return ()
    return parts


def _npu_ids(text: str) -> list[str]:
    out: list[str] = []
    for part in _gpu_list(text[:1024]):
        m = re.fullmatch(r"(\d{1,4})-(\d{1,4})", part)
        if m is None:
            out.append(part)
        elif int(m.group(2)) - int(m.group(1)) <= MAX_GPUS:
            out += [str(i) for i in range(int(m.group(1)), int(m.group(2)) + 1)]
        else:
            return []
    return out


def name(v: str) -> str:
    """A job, namespace, pod or node name: what the wire accepts (``limits.check_name``)."""
    try:
        check_name("name", v, MAX_NAME)
    except OutOfRange:  # said here without repeating the value, which the caller shows
        if len(v) > MAX_NAME:
            raise ConfigError(f"is {len(v)} characters long; at most {MAX_NAME}") from None
        raise ConfigError("contains control characters") from None
    return v


def _port(text: str) -> int | None:
    """A decimal port 0-65535 in ASCII digits, else None (never a 4,400-digit int())."""
    if not text.isascii() or not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if port <= 65535 else None


def split_host_port(v: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` too) -> (host without brackets, port); ConfigError if not."""
    host, sep, port_text = v.strip().rpartition(":")
    port = _port(port_text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or port is None or not host.isprintable() or " " in host:
        raise ConfigError("is not HOST:PORT")
    return host, port


def host_port(v: str) -> str:
    """One or more comma-separated HOST:PORT with a port 1-65535 (what agents dial)."""
    parts = [p.strip() for p in v.split(",") if p.strip()]
    if not parts:
        raise ConfigError("is not HOST:PORT")
    for part in parts:
        where = "" if len(parts) == 1 else f" (in {shown(part)})"
        try:
            _, port = split_host_port(part)
        except ConfigError:
            raise ConfigError(f"is not HOST:PORT{where}") from None
        if port == 0:
            raise ConfigError(f"has port 0, which cannot be dialled{where}")
    return v


def host(v: str) -> str:
    """An address to listen on (a name or an IP, without a port)."""
    if not v or len(v) > MAX_NAME or not v.isprintable() or " " in v:
        raise ConfigError("is not a host name or address")
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
    short: str | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag and an environment variable.

    Numeric fields need a ``Range`` as ``check``. Without ``metavar`` the placeholder in
    --help is derived: the flag's name for strings (``--job JOB``), N for ints, X for floats.
    """
    meta = {
        "flag": flag,
        "env": env or "FTAGENT_" + flag.lstrip("-").upper().replace("-", "_"),
        "help": help,
        "choices": choices,
        "check": check,
        "metavar": metavar,
        "sep": sep,
        "short": short,
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
        "counts per job)", check=RESTARTS, metavar="N")
    restart_backoff: float = opt(
        1.0, "--restart-backoff", "seconds before a local restart after a failure that "
        "repeats within --restart-backoff-window (the first one restarts at once); doubles "
        "with each further repeat up to --restart-backoff-max", check=SECONDS,
        metavar="SECONDS")
    restart_backoff_max: float = opt(
        30.0, "--restart-backoff-max", "cap on the local restart backoff",
        check=SECONDS, metavar="SECONDS")
    restart_backoff_window: float = opt(
        120.0, "--restart-backoff-window", "a failure this soon after the previous one is "
        "a repeat and backs off; after a longer healthy stretch the restart is immediate",
        check=SECONDS, metavar="SECONDS")
    warm_restart: bool = opt(
        True, "--warm-restart", "keep a standby interpreter per worker that has imported "
        "the trainer's modules and becomes the next attempt (Python commands, when a "
        "restart can happen), started once the attempt reached its first step; it costs "
        "host memory, ~250 MB per worker with torch, counted against the pod's limit; "
        "--no-warm-restart: every start is cold (default: on)")
    warm_imports: tuple[str, ...] = opt(
        (), "--warm-imports", "modules the standby imports, comma-separated (default: "
        "learned from the script's import statements)", check=modules, metavar="MODULES")
    warm_restart_memory_share: float = opt(
        0.9, "--warm-restart-memory-share", "start a standby only while the container's "
        "memory (cgroup working set, plus the standbys it adds) stays under this share of "
        "its memory limit; else restarts start cold (0: no check; no limit: no check)",
        check=Range(0, 1), metavar="SHARE")
    stop_timeout: float = opt(
        30.0, "--stop-timeout", "grace after SIGTERM before every process of the trainer's "
        "tree is SIGKILLed; on a restart, a trainer whose handler for the signal is gone (its "
        "Python is finalizing) gets the signal again at once", check=SECONDS, metavar="SECONDS")
    exit_timeout: float = opt(
        10.0, "--exit-timeout", "after the trainer's last exit, the agent's own cleanup "
        "(its tasks, closing the standbys; the goodbye to an arbiter that is away gets "
        "--arbiter-fail-open-after) ends within this, else the agent names what did not "
        "end in one error line and exits with the trainer's status all the same; after a "
        "stop signal, no later than --stop-timeout from the signal (at least 1 s)",
        check=Range(1, MAX_SECONDS), metavar="SECONDS")
    output_interval: float = opt(
        0.5, "--output-interval", "after a short read of the trainer's output, wait this "
        "long before the next: lines printed meanwhile reach the console together, up to "
        "this much later, for one wake-up of the agent instead of one per line (the first "
        "line after a quiet spell passes at once, the waits after it start at an eighth of "
        "this and double; 0: every write at once)",
        check=Range(0, 5), metavar="SECONDS")
    events_file: str = opt(
        "", "--events-file", "append one JSON line per event (state, fault, action) to "
        "this file", metavar="PATH")
    log_lines: int = opt(
        200, "--log-lines", "last output lines kept as evidence for faults",
        check=Range(1, MAX_LOG_LINES), metavar="N")
    log_level: str = opt(
        "info", "--log-level", "ftagent's own messages on stderr",
        choices=("debug", "info", "warning", "error"))
    exit_replace: int = opt(
        EXIT_REPLACE, "--exit-replace", "exit status when the arbiter replaces this rank "
        "(move the pod): 128-255 so Kubeflow's restartPolicy ExitCode retries it; match it "
        "in podFailurePolicy/JobSet rules", check=Range(1, 255), metavar="STATUS")
    exit_stop: int = opt(
        EXIT_STOP, "--exit-stop", "exit status when the arbiter stops the job: 1-127 so "
        "ExitCode does not retry it (alone, the agent exits with the trainer's status)",
        check=Range(1, 255, also=((-1, "the failing rank's status"),)), metavar="STATUS")
    preflight: bool = opt(
        True, "--preflight", "before every start and restart, before the barrier: the "
        "accelerators answer and their memory is usable, the watched links are up, "
        "--preflight-checkpoint-dir takes a file, the rendezvous (MASTER_ADDR) has a route, "
        "the devices store and compute right, each within its budget (5 s, 1 s, 5 s, 2 s, "
        "10 s); a failure is a fault that replaces this rank's pod; --no-preflight: off "
        "(default: on)")
    preflight_warm: str = opt(
        "fast", "--preflight-warm", "budgets on a restart in place: fast (2 s, 0.5 s, 2 s, "
        "1 s, no compute check: the devices answered moments ago) or full",
        choices=("fast", "full"))
    preflight_checkpoint_dir: str = opt(
        "", "--preflight-checkpoint-dir", "directory preflight checks is writable and "
        "readable (the trainer's checkpoints; default: none checked)", metavar="DIR")


@dataclass(frozen=True)
class IdentityConfig:
    """Who this agent is: labels on metrics, registration with the arbiter."""

    job: str = opt("", "--job", "job name (default: $TORCHELASTIC_RUN_ID, else 'local')",
                   check=name, metavar="JOB")
    namespace: str = opt("", "--namespace", "Kubernetes namespace (default: $POD_NAMESPACE)",
                         check=name, metavar="NAMESPACE")
    pod: str = opt("", "--pod", "pod name (default: $POD_NAME, else the hostname)",
                   check=name, metavar="POD")
    node: str = opt("", "--node", "node name (default: $NODE_NAME, else the hostname)",
                    check=name, metavar="NODE")
    rank: int = opt(
        -1, "--rank", "this agent's rank, below --world-size (default: $RANK, $GROUP_RANK, "
        "$PET_NODE_RANK, else 0)", check=Range(0, MAX_WORLD_SIZE - 1, also=((-1, "unset"),)),
        metavar="N")
    world_size: int = opt(
        -1, "--world-size", "agents in the job; the barrier waits for all of them "
        "(default: $WORLD_SIZE, $PET_NNODES, else 1)",
        check=Range(1, MAX_WORLD_SIZE, also=((-1, "unset"),)), metavar="N")
    gpus: tuple[str, ...] = opt(
        (), "--gpus", "the GPUs this pod holds, comma-separated UUIDs (GPU-..., MIG-...) or "
        "the node's GPU indices, so that a node agent's GPU fault reaches only the ranks on "
        "that GPU (default: $NVIDIA_VISIBLE_DEVICES as the NVIDIA device plugin sets it; "
        "unknown: every rank on the node counts as on it)", check=gpu_ids, metavar="GPUS")
    spare: bool = opt(
        False, "--spare", "join the job as a warm spare (needs --arbiter): keep the "
        "trainer's warm standby, run no trainer, and take over a rank the arbiter replaces "
        "(its RANK and WORLD_SIZE; --rank is not read); single-worker pods only")


@dataclass(frozen=True)
class MetricsConfig:
    metrics_port: int = opt(
        9430, "--metrics-port", "Prometheus /metrics port; 0 picks a free port, -1 turns "
        "metrics off", check=PORT_OR_OFF, metavar="PORT")
    metrics_addr: str = opt("0.0.0.0", "--metrics-addr", "address /metrics listens on",
                            check=host, metavar="ADDR")


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
        3.0, "--hang-timeout-min", "floor of the learned step budget (a budget running out "
        "is verified before it is declared: see --hang-verify-window)",
        check=POSITIVE_SECONDS, metavar="SECONDS")
    hang_factor: float = opt(
        10.0, "--hang-factor", "budget = factor x percentile of recent step intervals "
        "(a phase's: factor x its longest duration seen)", check=Range(0, 1e6, lo_open=True),
        metavar="FACTOR")
    hang_percentile: float = opt(99.0, "--hang-percentile", "percentile of recent step "
                                 "intervals the budget scales", check=PERCENTILE,
                                 metavar="P")
    hang_warmup_steps: int = opt(
        5, "--hang-warmup-steps", "steps observed before the learned budget applies; "
        "until then --hang-first-step-timeout holds", check=Range(0, MAX_COUNT),
        metavar="N")
    hang_first_step_timeout: float = opt(
        600.0, "--hang-first-step-timeout", "budget before the first steps (compilation, "
        "data loading, rendezvous)", check=POSITIVE_SECONDS, metavar="SECONDS")
    hang_phase_timeout: float = opt(
        1800.0, "--hang-phase-timeout", "budget for a declared long phase (checkpoint, "
        "eval) until its own duration is learned", check=POSITIVE_SECONDS, metavar="SECONDS")
    hang_dump_timeout: float = opt(
        10.0, "--hang-dump-timeout", "deadline for capturing py-spy stacks of the "
        "trainer tree", check=POSITIVE_SECONDS, metavar="SECONDS")
    hang_verify_window: float = opt(
        2.0, "--hang-verify-window", "sample the trainer's tree (stacks, CPU, I/O) over the "
        "last this many seconds of a running-out budget for signs of life, so a hang is "
        "declared verified when the budget ends; 0 declares on the budget alone",
        check=SECONDS, metavar="SECONDS")
    hang_verify_from: float = opt(
        0.33, "--hang-verify-from", "fraction of the budget before which no verification "
        "sample is taken (the window shrinks to fit after it); 1 samples only after the "
        "budget ran out, a window late", check=Range(0, 1), metavar="FRACTION")
    hang_verify_samples: int = opt(
        5, "--hang-verify-samples", "stack samples over the verification window",
        check=Range(2, 100), metavar="N")
    hang_spin_timeout: float = opt(
        120.0, "--hang-spin-timeout", "a trainer verified busy in a tight loop (one "
        "function, a few lines) is declared hung once stalled this long, unless a longer "
        "stall there was learned", check=POSITIVE_SECONDS, metavar="SECONDS")
    hang_culprit_spin_timeout: float = opt(
        30.0, "--hang-culprit-spin-timeout", "a trainer spinning while the other ranks are "
        "verified waiting on it in a collective (the arbiter's busy verdict names it) is "
        "declared hung once stalled this long; never when every rank is busy (an evaluation)",
        check=POSITIVE_SECONDS, metavar="SECONDS")
    fr_buffer_size: int = opt(
        2000, "--fr-buffer-size", "entries of PyTorch's flight recorder (TORCH_FR_BUFFER_SIZE, "
        "set only where the environment does not), dumped on a suspected hang so the "
        "arbiter can name who never reached which collective; 0 turns the recorder, its "
        "dump trigger and the TORCH_* variables off", check=Range(0, 1_000_000),
        metavar="ENTRIES")
    hang_dead_still_window: float = opt(
        60.0, "--hang-dead-still-window", "in a declared or never-learned phase, or before "
        "the first step, a trainer whose threads are all blocked with no CPU, no I/O and no "
        "stack movement this long is declared hung whatever the phase budget says; 0 off",
        check=Range(0, 86400), metavar="SECONDS")
    hang_io_timeout: float = opt(
        300.0, "--hang-io-timeout", "a trainer (or a process of its tree) blocked reading "
        "from a remote that is not a peer (a data server, an object store, a network "
        "mount) is waiting on I/O, not hung, for this long", check=POSITIVE_SECONDS,
        metavar="SECONDS")


@dataclass(frozen=True)
class LossConfig:
    """Loss anomalies: NaN/inf and spikes of the training loss (see detect/loss.py)."""

    loss_action: str = opt(
        "alert", "--loss-action", "what a NaN/inf loss or a loss spike does: alert (a LOSS "
        "fault, recorded and alerted), restart (the arbiter restarts the job), off (not "
        "watched)", choices=("alert", "restart", "off"))
    loss_spike_window: int = opt(
        100, "--loss-spike-window", "steps whose losses the spike score's median and MAD "
        "are taken over", check=Range(5, 100_000), metavar="STEPS")
    loss_spike_threshold: float = opt(
        10.0, "--loss-spike-threshold", "robust z-score, (loss - median) / (1.4826 x MAD), "
        "above which a loss is a spike", check=Range(0, 1e6, lo_open=True), metavar="SCORE")


@dataclass(frozen=True)
class ArbiterClientConfig:
    """How the agent reaches the arbiter; without --arbiter the local policy decides."""

    arbiter: str = opt(
        "", "--arbiter", "arbiter HOST:PORT; a comma-separated list shards jobs over "
        "replicas by a hash of the job", check=host_port, metavar="HOST:PORT[,...]")
    token: str = opt("", "--token", "token the arbiter requires: this job's token "
                     "(`ftagent token --job JOB`) or the arbiter's secret (prefer the "
                     "FTAGENT_TOKEN variable: flags show in ps)", metavar="TOKEN")
    token_file: str = opt("", "--token-file", "read the token from this file at every "
                          "(re)connect (in Kubernetes the pod's projected ServiceAccount "
                          "token, which the kubelet rotates); overrides --token",
                          metavar="PATH")
    tls_ca: str = opt("", "--tls-ca", "CA bundle to verify the arbiter (enables TLS)",
                      metavar="PATH")
    tls_cert: str = opt("", "--tls-cert", "client certificate for mTLS", metavar="PATH")
    tls_key: str = opt("", "--tls-key", "client key for mTLS", metavar="PATH")
    arbiter_fail_open_after: float = opt(
        15.0, "--arbiter-fail-open-after", "with the arbiter unreachable this long (at a "
        "start, a barrier, or awaiting a decision) the agent goes on alone: it starts the "
        "trainer and its local policy decides", check=SECONDS, metavar="SECONDS")
    exit_notes_dir: str = opt(
        "", "--exit-notes-dir", "the arbiter's --state-dir, where this agent shares it (one "
        "machine, a shared volume): an exit the arbiter did not confirm within "
        "--arbiter-fail-open-after is left there, so that `ftagent status` says succeeded "
        "or failed, not gone (in Kubernetes the pods' terminal status says it)",
        metavar="DIR")


# What `ftagent status` uses of ArbiterClientConfig: the address and the credentials.
CONNECTION_FIELDS = ("arbiter", "token", "token_file", "tls_ca", "tls_cert", "tls_key")


@dataclass(frozen=True)
class NicConfig:
    """Network links watched through netlink, RDMA ports through sysfs."""

    nic: tuple[str, ...] = opt(
        (), "--nic", "link to watch (repeatable, globs allowed; default: the "
        "NCCL/GLOO socket interfaces, else every non-loopback link up at start)",
        env="FTAGENT_NICS", metavar="NAME")
    nic_grace: float = opt(
        2.0, "--nic-grace", "a link down shorter than this is a flap, not a fault",
        check=SECONDS, metavar="SECONDS")
    rdma_sysfs: str = opt("/sys/class/infiniband", "--rdma-sysfs",
                          "root of the RDMA sysfs tree", metavar="PATH")
    nic_poll_interval: float = opt(
        1.0, "--nic-poll-interval", "RDMA port state and NIC counter polling interval",
        check=Range(0.01, MAX_SECONDS), metavar="SECONDS")
    nic_scope: str = opt(
        "pod", "--nic-scope", "scope of a NIC fault: pod (the pod's own network namespace) "
        "or node (hostNetwork / the node agent: the node's links)", choices=("pod", "node"))


_GPU_ACTION = re.compile(r"\s*(\d{1,5}|default)\s*=\s*(restart|reset_gpu|replace_node|ignore)\s*",
                         re.I)  # the actions of detect/gpu.py's GpuAction


def gpu_backend(v: str) -> str:
    if v in ("auto", "nvml", "none") or v.startswith("simulated:") and len(v) > 10:
        return v
    raise ConfigError("is not auto, nvml, none or simulated:FILE")


def xid_action(v: str) -> str:
    if not _GPU_ACTION.fullmatch(v):
        raise ConfigError("is not XID=ACTION (ACTION: restart, reset_gpu, replace_node, "
                          "ignore; XID a number or default)")
    return v


@dataclass(frozen=True)
class GpuConfig:
    """The trainer's GPUs, watched through NVML and the kernel log (sources/gpu.py)."""

    gpu_backend: str = opt(
        "auto", "--gpu-backend", "auto (NVML where a driver is, or the --accelerator's "
        "tool, npu-smi / xpu-smi; else off), nvml, none, or simulated:FILE (a scripted "
        "timeline of Xids, ECC errors, lost GPUs -- or of NPU/XPU error codes with "
        "--accelerator ascend|kunlunxin: drills, alerting tests)", check=gpu_backend,
        metavar="auto|nvml|none|simulated:FILE")
    gpu_poll_interval: float = opt(
        5.0, "--gpu-poll-interval", "ECC, row remapping, NVLink, throttle and recovery "
        "action polling interval", check=Range(0.05, MAX_SECONDS), metavar="SECONDS")
    gpu_xid_action: tuple[str, ...] = opt(
        (), "--gpu-xid-action", "override a row of the Xid table: XID=restart|reset_gpu|"
        "replace_node|ignore, or default=ACTION for Xids not in it (repeatable)",
        check=xid_action, metavar="XID=ACTION")
    accelerator: str = opt(
        "auto", "--accelerator", "which accelerators to watch: auto (what the node has: "
        "Ascend where npu-smi or /dev/davinci* is, Kunlunxin where xpu-smi or /dev/xpu* is, "
        "else NVIDIA), nvidia, ascend or kunlunxin (sources/accel.py); --gpu-backend "
        "simulated:FILE then drives that vendor's simulated tool",
        choices=("auto", "nvidia", "ascend", "kunlunxin"))
    dcmi_library: str = opt(
        "auto", "--dcmi-library", "Ascend: read health and error codes through the DCMI "
        "library instead of a npu-smi process per NPU: auto (libdcmi.so where it loads; "
        "not with --gpu-backend simulated:FILE), none, or a PATH",
        metavar="auto|none|PATH")
    kmsg: str = opt(
        "auto", "--kmsg", "kernel log read for NVRM Xid lines: auto (/dev/kmsg where "
        "readable, new lines only), none, or a PATH (a FIFO or a file, read from its start)",
        metavar="auto|none|PATH")


def nproc(v: str) -> str:
    """``--nproc-per-node``: a count, or torchrun's gpu, cpu, auto."""
    if v in ("gpu", "cpu", "auto"):
        return v
    if not v.isascii() or not v.isdigit() or len(v) > 7:
        raise ConfigError("is not a number of workers, gpu, cpu or auto")
    if int(v) < 1:
        raise ConfigError("must be at least 1 (one worker per GPU, or --nproc-per-node cpu)")
    return v


def std_map(v: str) -> str:
    """torchrun's ``--tee``/``--redirects``: 0-3 for every worker, or LOCAL_RANK:0-3,..."""
    parts = [p.strip() for p in v.split(",")]
    ok = re.fullmatch(r"[0-3]", v.strip()) or all(
        re.fullmatch(r"\d{1,7}:[0-3]", p) for p in parts)
    if not ok:
        raise ConfigError("is not 0-3 (1 stdout, 2 stderr, 3 both) or LOCAL_RANK:0-3,...")
    return v


@dataclass(frozen=True)
class LaunchConfig:
    """ftagent as the launcher: torchrun's flags, one supervised worker per local rank."""

    nproc_per_node: str = opt(
        "", "--nproc-per-node", "start this many workers (torchrun's environment "
        "contract), or gpu, cpu, auto; unset: run CMD as the one trainer", check=nproc,
        metavar="N")
    nnodes: str = opt(
        "", "--nnodes", "nodes (pods) in the job (default: $PET_NNODES, else --world-size)",
        metavar="N")
    node_rank: int = opt(
        -1, "--node-rank", "this node's rank (default: $PET_NODE_RANK, else --rank)",
        check=Range(0, MAX_WORLD_SIZE - 1, also=((-1, "unset"),)), metavar="N")
    master_addr: str = opt(
        "", "--master-addr", "address of rank 0's store (default: $PET_MASTER_ADDR, "
        "$MASTER_ADDR, else 127.0.0.1)", check=host, metavar="ADDR")
    master_port: int = opt(
        -1, "--master-port", "port of rank 0's store (default: $PET_MASTER_PORT, "
        "$MASTER_PORT, else 29500)", check=Range(1, 65535, also=((-1, "unset"),)),
        metavar="PORT")
    rdzv_backend: str = opt("static", "--rdzv-backend", "rendezvous: static only (a fixed "
                            "group; the arbiter's barrier does the rest)", metavar="static")
    rdzv_endpoint: str = opt("", "--rdzv-endpoint", "HOST:PORT of rank 0's store (static "
                             "rendezvous: the same as --master-addr/--master-port)",
                             metavar="HOST:PORT")
    rdzv_id: str = opt("", "--rdzv-id", "run id the workers see as $TORCHELASTIC_RUN_ID "
                       "(alias --run-id; default: none)", check=name, metavar="ID")
    standalone: bool = opt(False, "--standalone", "one node on localhost, a free port and a "
                           "fresh run id")
    module: bool = opt(False, "--module", "CMD is a Python module (python -m CMD)",
                       short="-m")
    no_python: bool = opt(False, "--no-python", "run CMD as it is, not with Python")
    role: str = opt("default", "--role", "role name the workers see as $ROLE_NAME",
                    check=name, metavar="ROLE")
    tee: str = opt("0", "--tee", "copy worker streams to files in --log-dir and to the "
                   "console with a [ROLE LOCAL_RANK]: prefix: 1 stdout, 2 stderr, 3 both, "
                   "or LOCAL_RANK:N,...", check=std_map, metavar="N", short="-t")
    redirects: str = opt("0", "--redirects", "write worker streams to files in --log-dir "
                         "instead of the console (as --tee)", check=std_map, metavar="N",
                         short="-r")
    log_dir: str = opt("", "--log-dir", "directory for --tee/--redirects files (default: "
                       "a temporary one)", metavar="DIR")
    local_ranks_filter: str = opt(
        "", "--local-ranks-filter", "show only these local ranks' output on the console "
        "(comma-separated)", metavar="LOCAL_RANK,...")


@dataclass(frozen=True)
class SnapshotConfig:
    """In-memory snapshots (``ftagent.checkpoint``): where they live, their cap, and the
    job's durable checkpoint directory the agent persists them to. The trainer gets
    ``FTAGENT_SNAPSHOT_DIR``, ``FTAGENT_SNAPSHOT_MAX_BYTES``, ``FTAGENT_CHECKPOINT_DIR``
    (its disk rung); nothing is held unless it calls ``checkpoint.save``."""

    snapshot_dir: str = opt(
        "/dev/shm/ftagent-snapshots", "--snapshot-dir", "memory-backed directory "
        "(tmpfs: /dev/shm, or a medium: Memory emptyDir) where ftagent.checkpoint keeps "
        "each rank's snapshots; they outlive the trainer, not the pod", metavar="DIR")
    snapshot_memory_share: float = opt(
        0.25, "--snapshot-memory-share", "cap on one rank's snapshots as a share of the "
        "container's memory limit (tmpfs counts toward it); past it fewer are kept, said "
        "once (0: no cap; no limit: no cap)", check=Range(0, 1), metavar="SHARE")
    snapshot_budget: float = opt(
        0.0, "--snapshot-budget", "share of training time ftagent.checkpoint.save may block "
        "(e.g. 0.01): call it every step and it snapshots only as often as its measured "
        "copy time allows (0: every call snapshots)", check=Range(0, 1), metavar="SHARE")
    checkpoint_dir: str = opt(
        "", "--checkpoint-dir", "the job's durable checkpoint directory: snapshots are "
        "persisted there in DCP layout (every --persist-every snapshots, and on SIGTERM)",
        metavar="DIR")
    persist_every: int = opt(
        0, "--persist-every", "the agent persists every N-th snapshot to --checkpoint-dir "
        "in the background (0: not by count)", check=Range(0, 1_000_000), metavar="N")
    persist_seconds: float = opt(
        0.0, "--persist-seconds", "the agent persists the newest snapshot to "
        "--checkpoint-dir once this long has passed since the last one (0: not by time; "
        "with neither, only on SIGTERM)", check=Range(0, 86400 * 30), metavar="SECONDS")
    replica_listen: str = opt(
        "", "--replica-listen", "serve peer replicas on this address (port 0: any): "
        "other ranks' agents copy their newest snapshot here, and a replaced pod's agent "
        "fetches it back. Under --arbiter the arbiter places the replicas in a ring by node "
        "and hands out the job's channel key; without one, needs the job token (--token) "
        "and --replica-peer (off when empty)", metavar="HOST:PORT")
    replica_peer: str = opt(
        "", "--replica-peer", "the agent that keeps this rank's replica (the next node's "
        "--replica-listen), overriding the arbiter's ring: each newer complete snapshot is "
        "copied there in the background, and a rank starting with none in memory fetches it "
        "from there first (empty: the arbiter's choice, else off)", metavar="HOST:PORT")
    replica_bandwidth: int = opt(
        100 << 20, "--replica-bandwidth", "bytes per second one replica copy may send "
        "(0: unpaced)", check=Range(0, (1 << 31) - 1), metavar="BYTES")


@dataclass(frozen=True)
class StatusConfig:
    """``ftagent status``'s own flags (the arbiter connection is ArbiterClientConfig's)."""

    namespace: str = opt("", "--namespace", "the job's namespace (when its name is in "
                         "several); without JOB, list only this namespace's jobs",
                         check=name, metavar="NAMESPACE")
    json: bool = opt(False, "--json", "machine-readable output")
    follow: bool = opt(False, "--follow", "stream timeline entries as they happen "
                       "(Ctrl-C to stop)", short="-f")
    timeline: int = opt(50, "--timeline", "timeline entries shown for JOB (0: all kept)",
                        check=Range(0, MAX_COUNT), metavar="N")
    kube_credentials: bool = opt(
        False, "--kube-credentials", "present your own Kubernetes credentials (the bearer "
        "token of $KUBECONFIG's current context, or ~/.kube/config's: token, tokenFile, "
        "exec plugin or OIDC id-token) instead of --token: an arbiter with --operators "
        "checks them and lets the cluster's RBAC decide what you may read")


@dataclass(frozen=True)
class RunConfig:
    """Everything ``ftagent run`` needs; ``command`` is what follows ``--``."""

    command: tuple[str, ...]
    supervisor: SupervisorConfig = SupervisorConfig()
    identity: IdentityConfig = IdentityConfig()
    metrics: MetricsConfig = MetricsConfig()
    hang: HangConfig = HangConfig()
    loss: LossConfig = LossConfig()
    arbiter: ArbiterClientConfig = ArbiterClientConfig()
    nic: NicConfig = NicConfig()
    gpu: GpuConfig = GpuConfig()
    launch: LaunchConfig = LaunchConfig()
    snapshot: SnapshotConfig = SnapshotConfig()


RUN_GROUPS: dict[str, tuple[str, type[Any]]] = {
    "supervisor": ("supervisor", SupervisorConfig),
    "identity": ("identity (labels, arbiter registration)", IdentityConfig),
    "metrics": ("metrics", MetricsConfig),
    "hang": ("progress and hang detection", HangConfig),
    "loss": ("loss anomalies", LossConfig),
    "arbiter": ("arbiter connection", ArbiterClientConfig),
    "nic": ("network links", NicConfig),
    "gpu": ("GPUs (NVML, kernel log)", GpuConfig),
    "launch": ("launcher (torchrun's flags; --nproc-per-node starts the workers)",
               LaunchConfig),
    "snapshot": ("in-memory snapshots (ftagent.checkpoint)", SnapshotConfig),
}


# --------------------------------------------------------------------------- parsing


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help of every command: descriptions and epilogs as written, 100 columns."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), never the usage block."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _type_name(typ: Any) -> str:
    return str(getattr(typ, "__name__", typ))


def _convert(raw: str, typ: Any, meta: Mapping[str, Any], source: str) -> Any:
    """Parse one raw string for a field of type ``typ``; raise ConfigError naming ``source``."""
    try:
        if typ in (int, "int"):
            value: Any = int(raw)  # ValueError also for > 4,300 digits
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
        raise ConfigError(f"{source}: {shown(raw)} is not a valid {_type_name(typ)}") from None
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{source}: {shown(raw)} is not one of {', '.join(meta['choices'])}")
    if meta.get("check"):
        try:
            value = meta["check"](value)
        except ConfigError as e:
            raise ConfigError(f"{source}: {shown(raw)} {e}") from None
    return value


def _is_multi(typ: Any) -> bool:
    return str(typ).startswith("tuple")


def _is_numeric(typ: Any) -> bool:
    return typ in (int, float, "int", "float")


def _fields(cls: type[Any], only: Sequence[str] | None) -> list[dataclasses.Field[Any]]:
    fields = list(dataclasses.fields(cls))
    if only is None:
        return fields
    unknown = set(only) - {f.name for f in fields}
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    return [f for f in fields if f.name in only]


def metavar_of(f: dataclasses.Field[Any], typ: Any) -> str | None:
    """The placeholder --help shows after the flag (None: argparse's own, for choices and
    switches): the field's ``metavar``, else N for ints, X for floats, the flag's name."""
    meta = f.metadata
    if meta.get("choices") or typ in (bool, "bool"):
        return None
    if meta.get("metavar"):
        return str(meta["metavar"])
    if typ in (int, "int"):
        return "N"
    if typ in (float, "float"):
        return "X"
    return str(meta["flag"]).lstrip("-").upper().replace("-", "_")


def add_group(parser: argparse.ArgumentParser, title: str, cls: type[Any],
              only: Sequence[str] | None = None) -> None:
    """Add every field of the dataclass ``cls`` (or those named in ``only``) as a flag in
    an argument group."""
    group = parser.add_argument_group(title)
    hints = get_type_hints(cls)
    for f in _fields(cls, only):
        meta = f.metadata
        typ = hints[f.name]
        if _is_numeric(typ) and not isinstance(meta.get("check"), Range):
            raise TypeError(f"{cls.__name__}.{f.name}: a numeric flag needs a Range check")
        multi = _is_multi(typ)
        default = f.default
        hidden = default in ("", (), -1) or isinstance(default, bool)
        shown_default = "" if hidden else f" (default: {default})"
        kwargs: dict[str, Any] = {
            "dest": f"{cls.__name__}.{f.name}",
            "help": f"{meta['help']}{shown_default} [env {meta['env']}]".replace("%", "%%"),
            "default": None,
        }
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        metavar = metavar_of(f, typ)
        if metavar:
            kwargs["metavar"] = metavar
        if multi:
            kwargs["action"] = "append"
        elif typ in (bool, "bool") and str(meta["flag"]).startswith("--no-"):
            # already a negation (torchrun's --no-python): one flag, no "--no-no-python"
            kwargs.update(action="store_const", const=True)
        elif typ in (bool, "bool"):
            kwargs["action"] = argparse.BooleanOptionalAction
        flags = [meta["short"], meta["flag"]] if meta.get("short") else [meta["flag"]]
        group.add_argument(*flags, **kwargs)


def resolve_group(
    ns: argparse.Namespace, cls: type[T], environ: Mapping[str, str],
    only: Sequence[str] | None = None, origins: dict[str, str] | None = None,
) -> T:
    """Build the dataclass ``cls`` from parsed flags, then FTAGENT_* variables, then defaults.

    With ``only``, the other fields keep their defaults. ``origins``, when given, is filled
    with where each set field came from (its flag or its variable), for error messages.
    """
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in _fields(cls, only):
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
                if origins is not None:
                    origins[f.name] = source
            continue
        if raw is None and meta["env"] in environ and environ[meta["env"]] != "":
            values[f.name] = _convert(environ[meta["env"]], typ, meta, meta["env"])
            source = meta["env"]
        elif raw is not None:
            source = meta["flag"]
            if isinstance(raw, bool) or typ is str and meta.get("check") is None:
                values[f.name] = raw
            else:
                values[f.name] = _convert(str(raw), typ, meta, meta["flag"])
        else:
            continue
        if origins is not None:
            origins[f.name] = source
    return cls(**values)


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``[options] -- CMD ARGS`` at the first ``--``."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def unrecognized(extra: Sequence[str], separated: bool, prog: str = "ftagent run") -> str:
    """The error for arguments no flag took. Without a ``--``, words that are not flags
    are most likely the command itself: say where it goes (argparse alone says only
    "unrecognized arguments")."""
    words = " ".join(shlex.quote(w) for w in extra)
    if len(words) > 200:
        words = words[:200] + "..."
    if separated or extra[0].startswith("-"):
        return f"unrecognized arguments: {words}"
    return (f"unrecognized arguments: {words}; put the command after --: "
            f"{prog} [flags] -- {words}")


def env_first(environ: Mapping[str, str], *names: str) -> str:
    for n in names:
        if environ.get(n):
            return environ[n]
    return ""


def _env_int(environ: Mapping[str, str], names: Sequence[str], flag: str) -> tuple[int, str]:
    """The first of ``names`` that is set, as an int, and ``$NAME`` (its source); (-1, "")
    when none is set."""
    for n in names:
        raw = environ.get(n, "")
        if raw.strip():
            try:
                return int(raw), f"${n}"
            except ValueError:
                raise ConfigError(f"${n}: {shown(raw)} is not a valid int (read as the "
                                  f"default of {flag}; set {flag} to override)") from None
    return -1, ""


def _short(v: int) -> str:
    text = str(v)
    return text if len(text) <= 20 else f"{text[:20]}... ({len(text)} digits)"


def _env_name(environ: Mapping[str, str], *names: str) -> str:
    """The first of ``names`` that is set, checked like a --job/--pod/... value."""
    for n in names:
        value = environ.get(n, "")
        if value:
            try:
                return check_name(f"${n}", value, MAX_NAME)
            except OutOfRange as e:
                raise ConfigError(str(e)) from None
    return ""


def identity(cfg: IdentityConfig, environ: Mapping[str, str],
             origins: Mapping[str, str] | None = None) -> IdentityConfig:
    """Fill identity fields from the variables torchrun, Kubeflow and the Downward API set.

    The rank must be in [0, world size) and the world size in [1, MAX_WORLD_SIZE], from
    whichever source each came (flag, FTAGENT_* variable, the torchrun/Kubeflow fallbacks,
    or the defaults 0 and 1); an error names the sources. ``origins``: where the fields
    of ``cfg`` came from (see ``resolve_group``).
    """
    origins = origins or {}
    rank, rank_from = cfg.rank, origins.get("rank", "--rank")
    if rank < 0:
        rank, rank_from = _env_int(environ, ("RANK", "GROUP_RANK", "PET_NODE_RANK"), "--rank")
        if not rank_from:
            rank, rank_from = 0, "the default"
    world, world_from = cfg.world_size, origins.get("world_size", "--world-size")
    if world < 0:
        world, world_from = _env_int(environ, ("WORLD_SIZE", "PET_NNODES"), "--world-size")
        if not world_from:
            world, world_from = 1, ("the default: none of --world-size, FTAGENT_WORLD_SIZE, "
                                    "$WORLD_SIZE, $PET_NNODES is set")
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise ConfigError(f"world size {_short(world)} (from {world_from}) must be in "
                          f"[1, {MAX_WORLD_SIZE}]")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {_short(rank)} (from {rank_from}) must be in [0, {world}): the "
                          f"world size is {world} (from {world_from})")
    gpus = tuple(p for g in cfg.gpus for p in _gpu_list(g))
    if len(gpus) > MAX_GPUS:
        raise ConfigError(f"--gpus names {len(gpus)} GPUs; at most {MAX_GPUS}")
    host = _env_name(environ, "HOSTNAME") or os.uname().nodename
    return dataclasses.replace(
        cfg,
        job=cfg.job or _env_name(environ, "TORCHELASTIC_RUN_ID") or "local",
        namespace=cfg.namespace or _env_name(environ, "POD_NAMESPACE"),
        pod=cfg.pod or _env_name(environ, "POD_NAME") or host,
        node=cfg.node or _env_name(environ, "NODE_NAME") or host,
        rank=rank,
        world_size=world,
        gpus=gpus or visible_gpu_ids(environ),
    )
