"""ftagent as the launcher: torchrun's flags, the node's place, and each worker's env.

Pure: flags, the environment and the node's GPUs in; values out. ``worker.py`` runs
what this describes.

The environment contract is torchrun 2.13's (run it and diff: tests/integration/
test_launcher.py does), key by key::

    RANK LOCAL_RANK GROUP_RANK ROLE_RANK ROLE_NAME WORLD_SIZE LOCAL_WORLD_SIZE
    GROUP_WORLD_SIZE ROLE_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT
    TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_RUN_ID TORCHELASTIC_USE_AGENT_STORE
    TORCHELASTIC_ERROR_FILE TORCHELASTIC_SIGNALS_TO_HANDLE TORCH_NCCL_ASYNC_ERROR_HANDLING
    OMP_NUM_THREADS (=1 when unset and more than one worker)

One value differs on purpose: ``TORCHELASTIC_USE_AGENT_STORE=False``. torchrun's agent
hosts the TCPStore and every worker dials it; ftagent imports no torch, so rank 0 hosts
the store (``init_process_group``'s env:// does that when the variable is not True), and
a restarted generation gets a fresh store by construction: the previous attempt's
addresses are never met (pytorch #135712).

The node's place, first that is set: ``--node-rank``/``FTAGENT_NODE_RANK``,
``$PET_NODE_RANK`` (Kubeflow Trainer, and torchrun's own PET_* variables), then the
identity's rank (``--rank``/``FTAGENT_RANK`` as the webhook injects it, ``$RANK`` as the
Training Operator sets it: the pod's index). ``--nnodes`` likewise from ``$PET_NNODES``,
then the identity's world size (``$WORLD_SIZE``: the pods). The master from
``--rdzv-endpoint``, ``--master-addr/--master-port``, ``$PET_MASTER_*``, ``$MASTER_*``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from string import Template

from ftagent.config import ConfigError, IdentityConfig, LaunchConfig, split_host_port
from ftagent.wire.limits import MAX_WORLD_SIZE

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torchrun's
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default, passed on as is
MAX_NPROC = 4096

# torchrun spells every flag both ways; ftagent's own flags are dashed.
ALIASES = {
    "--nproc_per_node": "--nproc-per-node", "--max_restarts": "--max-restarts",
    "--node_rank": "--node-rank", "--master_addr": "--master-addr",
    "--master_port": "--master-port", "--rdzv_backend": "--rdzv-backend",
    "--rdzv_endpoint": "--rdzv-endpoint", "--rdzv_id": "--rdzv-id", "--run-id": "--rdzv-id",
    "--run_id": "--rdzv-id", "--log_dir": "--log-dir", "--no_python": "--no-python",
    "--local_ranks_filter": "--local-ranks-filter", "--shutdown-timeout": "--stop-timeout",
    "--shutdown_timeout": "--stop-timeout",
}

# torchrun flags ftagent does not take, each with what to do instead (exit 2, never ignored)
UNSUPPORTED = {
    "--rdzv-conf": "rendezvous is static; the arbiter's barrier joins the nodes",
    "--monitor-interval": "ftagent hears of an exit at once (SIGCHLD); drop it",
    "--start-method": "workers are always new processes running CMD; drop it",
    "--event-log-handler": "use --events-file",
    "--run-path": "run the script with python instead",
    "--duplicate-stdout-filters": "not supported",
    "--duplicate-stderr-filters": "not supported",
    "--local-addr": "not supported",
    "--logs-specs": "use --tee/--redirects/--log-dir",
    "--numa-binding": "not supported; bind in CMD (numactl)",
    "--signals-to-handle": "ftagent forwards SIGTERM, SIGINT and SIGHUP",
    "--virtual-local-rank": "not supported",
    "--use-env": "the environment is always set (torchrun's default)",
    "--max-nodes": "elastic sizes are not supported: --nnodes N",
}


def normalize_flags(opts: Sequence[str]) -> list[str]:
    """torchrun's spellings -> ftagent's; ConfigError for a torchrun flag not supported."""
    out = []
    for opt in opts:
        flag, eq, value = opt.partition("=")
        flag = ALIASES.get(flag, flag)
        dashed = flag.replace("_", "-") if flag.startswith("--") else flag
        if dashed in UNSUPPORTED:
            raise ConfigError(f"{flag} (a torchrun flag) is not supported: "
                              f"{UNSUPPORTED[dashed]}")
        out.append(flag + eq + value if eq else flag)
    return out


@dataclass(frozen=True)
class NodePlace:
    """Where this node's workers stand in the job."""

    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    run_id: str
    role: str = "default"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    def rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 9:
        raise ConfigError(f"${name}: {raw[:40]!r} is not a valid count")
    return int(raw)


def count_nproc(spec: str, gpus: int, cpus: int) -> int:
    """``--nproc-per-node``: N, gpu (an error without GPUs), cpu, auto (gpu, else cpu)."""
    if spec == "gpu":
        if gpus < 1:
            raise ConfigError("--nproc-per-node gpu: no GPU is visible (NVML, "
                              "$CUDA_VISIBLE_DEVICES); give a number or cpu")
        return gpus
    if spec == "cpu":
        return max(1, cpus)
    if spec == "auto":
        return gpus if gpus > 0 else max(1, cpus)
    n = int(spec)
    if n > MAX_NPROC:
        raise ConfigError(f"--nproc-per-node {n} is more than {MAX_NPROC} workers")
    return n


def _nnodes(spec: str, source: str) -> int:
    lo, sep, hi = spec.partition(":")
    if sep and lo != hi:
        raise ConfigError(f"{source} {spec}: elastic sizes are not supported; the job has "
                          "a fixed number of nodes (--nnodes N)")
    if not lo.isascii() or not lo.isdigit() or not 1 <= int(lo[:9] or 0) <= MAX_WORLD_SIZE:
        raise ConfigError(f"{source} {spec[:40]!r} is not a number of nodes in "
                          f"[1, {MAX_WORLD_SIZE}]")
    return int(lo)


def node_place(launch: LaunchConfig, ident: IdentityConfig, environ: Mapping[str, str],
               *, gpus: int = 0, cpus: int | None = None) -> NodePlace:
    """The node's place from flags, PET_*/MASTER_* variables and the identity."""
    nproc = count_nproc(launch.nproc_per_node, gpus, cpus or os.cpu_count() or 1)
    if launch.nnodes:
        nnodes = _nnodes(launch.nnodes, "--nnodes")
    elif environ.get("PET_NNODES", "").strip():
        nnodes = _nnodes(environ["PET_NNODES"].strip(), "$PET_NNODES")
    else:
        nnodes = ident.world_size
    if launch.node_rank >= 0:
        node_rank, rank_from = launch.node_rank, "--node-rank"
    elif (pet := _env_int(environ, "PET_NODE_RANK")) is not None:
        node_rank, rank_from = pet, "$PET_NODE_RANK"
    else:
        node_rank, rank_from = ident.rank, "the agent's rank (--rank, $RANK)"
    if launch.standalone:
        if nnodes != 1 and launch.nnodes:
            raise ConfigError("--standalone is one node: drop --nnodes or set it to 1")
        nnodes, node_rank = 1, 0
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"node rank {node_rank} (from {rank_from}) must be below the "
                          f"number of nodes, {nnodes} (--nnodes, $PET_NNODES)")
    if nnodes * nproc > MAX_WORLD_SIZE:
        raise ConfigError(f"{nnodes} nodes x {nproc} workers is more than {MAX_WORLD_SIZE}")
    if launch.rdzv_backend != "static":
        raise ConfigError(f"--rdzv-backend {launch.rdzv_backend} is not supported: ftagent "
                          "starts a fixed group (static); give --node-rank and "
                          "--master-addr/--master-port, or --rdzv-endpoint")
    addr, port = _master(launch, environ)
    run_id = launch.rdzv_id or ("none" if not launch.standalone else str(uuid.uuid4()))
    if launch.standalone:
        addr, port = "localhost", 0  # 0: the caller picks a free port
    return NodePlace(nproc, nnodes, node_rank, addr, port, run_id, launch.role)


def _master(launch: LaunchConfig, environ: Mapping[str, str]) -> tuple[str, int]:
    if launch.rdzv_endpoint:
        host, _, port_text = launch.rdzv_endpoint.rpartition(":")
        if not host:  # torchrun: an endpoint without a port uses the default
            return launch.rdzv_endpoint, DEFAULT_MASTER_PORT
        try:
            return split_host_port(launch.rdzv_endpoint)
        except ConfigError:
            raise ConfigError(f"--rdzv-endpoint {launch.rdzv_endpoint[:60]!r} is not "
                              "HOST:PORT") from None
    addr = launch.master_addr or environ.get("PET_MASTER_ADDR") or \
        environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR
    if launch.master_port > 0:
        return addr, launch.master_port
    for var in ("PET_MASTER_PORT", "MASTER_PORT"):
        port = _env_int(environ, var)
        if port is not None:
            if not 1 <= port <= 65535:
                raise ConfigError(f"${var}: {port} is not a port in [1, 65535]")
            return addr, port
    return addr, DEFAULT_MASTER_PORT


PYTHON_NAME = re.compile(r"python[\d.]*$")


def python_exec(environ: Mapping[str, str]) -> str:
    """The interpreter for a bare script: $PYTHON_EXEC, else this Python (torchrun's
    rule); in the self-contained bundle, which is no Python, the PATH's python3."""
    if environ.get("PYTHON_EXEC"):
        return environ["PYTHON_EXEC"]
    if getattr(sys, "frozen", False):
        found = shutil.which("python3", path=environ.get("PATH", os.defpath)) or \
            shutil.which("python", path=environ.get("PATH", os.defpath))
        if found is None:
            raise ConfigError("no python3 on PATH to run the script (set PYTHON_EXEC, or "
                              "give the command as python SCRIPT)")
        return found
    return sys.executable


def worker_command(launch: LaunchConfig, command: Sequence[str],
                   environ: Mapping[str, str], cwd: str = ".") -> tuple[str, ...]:
    """What each worker runs, as torchrun would: ``train.py ARGS`` -> ``PYTHON -u train.py
    ARGS``; ``-m``: ``PYTHON -u -m MODULE ARGS``; ``--no-python`` or a command that is
    already ``python ...`` (or any executable that is not a .py file): as given."""
    if not command:
        raise ConfigError("no command to run: ftagent run --nproc-per-node N -- SCRIPT [ARGS...]")
    first = command[0]
    if launch.module and launch.no_python:
        raise ConfigError("--module and --no-python do not go together (as in torchrun)")
    if launch.no_python:
        return tuple(command)
    if launch.module:
        return (python_exec(environ), "-u", "-m", *command)
    if PYTHON_NAME.match(os.path.basename(first)):
        return tuple(command)
    script = first if os.path.isabs(first) else os.path.join(cwd, first)
    if first.endswith(".py") or not shutil.which(first, path=environ.get("PATH", os.defpath)):
        if not os.path.isfile(script):
            raise ConfigError(f"script not found: {first}")
        return (python_exec(environ), "-u", *command)
    return tuple(command)


def worker_env(base: Mapping[str, str], place: NodePlace, local_rank: int, *,
               restart_count: int, max_restarts: int, error_file: str = "") -> dict[str, str]:
    """One worker's environment: ``base`` plus torchrun's contract (module docstring)."""
    env = dict(base)
    rank = place.rank(local_rank)
    env.update({
        "LOCAL_RANK": str(local_rank), "RANK": str(rank), "GROUP_RANK": str(place.node_rank),
        "ROLE_RANK": str(rank), "ROLE_NAME": place.role,
        "LOCAL_WORLD_SIZE": str(place.nproc), "WORLD_SIZE": str(place.world_size),
        "GROUP_WORLD_SIZE": str(place.nnodes), "ROLE_WORLD_SIZE": str(place.world_size),
        "MASTER_ADDR": place.master_addr, "MASTER_PORT": str(place.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": place.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",  # rank 0 hosts the store (docstring)
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    })
    if place.nproc > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    return env


def std_of(spec: str, local_rank: int) -> int:
    """torchrun's Std for one worker: 0 none, 1 stdout, 2 stderr, 3 both."""
    spec = spec.strip()
    if ":" not in spec:
        return int(spec or 0)
    for part in spec.split(","):
        lr, _, v = part.partition(":")
        if int(lr) == local_rank:
            return int(v)
    return 0


def ranks_filter(spec: str) -> set[int] | None:
    """``--local-ranks-filter 0,2`` -> {0, 2}; None shows every worker."""
    if not spec.strip():
        return None
    try:
        ranks = {int(p) for p in spec.split(",") if p.strip()}
    except ValueError:
        raise ConfigError(f"--local-ranks-filter {spec[:40]!r} is not a comma-separated "
                          "list of local ranks") from None
    return ranks or None


def line_prefix(place: NodePlace, local_rank: int, environ: Mapping[str, str]) -> bytes:
    """torchrun's console prefix: ``[ROLE LOCAL_RANK]:`` (``[default0]:``), or its
    $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE with ${role_name}, ${rank}, ${local_rank}."""
    template = environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    if template:
        return Template(template).safe_substitute(
            role_name=place.role, rank=place.rank(local_rank),
            local_rank=local_rank).encode()
    return f"[{place.role}{local_rank}]:".encode()


def visible_gpus(environ: Mapping[str, str]) -> int:
    """GPUs a worker per GPU would get: $CUDA_VISIBLE_DEVICES if set, else /dev/nvidia*."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)])
    except OSError:
        return 0


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` (--standalone's store, as torchrun picks one)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
