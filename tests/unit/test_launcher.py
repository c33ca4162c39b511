"""The launcher's pure parts: torchrun's flags, the node's place, the worker env."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ftagent.agent import launcher
from ftagent.agent.tee import PrefixedLines
from ftagent.cmd import run as run_cli
from ftagent.config import ConfigError, IdentityConfig, LaunchConfig


def place(argv: list[str], environ: dict[str, str] | None = None) -> launcher.NodePlace:
    cfg = run_cli.parse([*argv, "--", "true"], environ or {})
    return launcher.node_place(cfg.launch, cfg.identity, environ or {}, gpus=0, cpus=2)


def test_torchrun_spellings_and_aliases() -> None:
    cfg = run_cli.parse(["--nproc_per_node=2", "--max_restarts", "3", "--node_rank=1",
                         "--nnodes", "2", "--master_addr=h", "--master_port", "1234",
                         "--run-id", "job7", "--log_dir=/tmp/x", "-t", "3", "--", "true"], {})
    la = cfg.launch
    assert (la.nproc_per_node, la.node_rank, la.master_addr, la.master_port) == ("2", 1, "h",
                                                                                  1234)
    assert (la.rdzv_id, la.log_dir, la.tee, cfg.supervisor.max_restarts) == \
        ("job7", "/tmp/x", "3", 3)


@pytest.mark.parametrize("flag", ["--rdzv-conf=a=b", "--rdzv_conf", "--monitor-interval=1",
                                  "--start_method=spawn", "--numa-binding=node", "--run-path"])
def test_unsupported_torchrun_flag_is_one_line_exit_2(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli.main(["--nproc-per-node=2", flag, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a torchrun flag) is not supported" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--nproc-per-node=0"], "must be at least 1"),
    (["--nproc-per-node=x"], "is not a number of workers"),
    (["--nproc-per-node=2", "--nnodes=1:4"], "elastic sizes are not supported"),
    (["--nproc-per-node=2", "--rdzv-backend=c10d"], "--rdzv-backend c10d is not supported"),
    (["--nproc-per-node=2", "--nnodes=2", "--node-rank=2"], "must be below the number"),
    (["--nproc-per-node=gpu"], "no GPU is visible"),
])
def test_bad_launch_values(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        place(argv, {"CUDA_VISIBLE_DEVICES": ""})


def test_node_place_sources_in_order() -> None:
    # Kubeflow Trainer's PET_* variables
    p = place(["--nproc-per-node=4"], {"PET_NNODES": "3", "PET_NODE_RANK": "2",
                                       "PET_MASTER_ADDR": "m0", "PET_MASTER_PORT": "23456"})
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (3, 2, "m0", 23456)
    assert (p.world_size, p.rank(0), p.rank(3)) == (12, 8, 11)
    # the Training Operator's: RANK is the pod's index, WORLD_SIZE the pods
    p = place(["--nproc-per-node=2"], {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m",
                                       "MASTER_PORT": "1"})
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (2, 1, "m", 1)
    # flags win; an endpoint is the master under static rendezvous
    p = place(["--nproc-per-node=2", "--nnodes=4", "--node-rank=3", "--rdzv-endpoint=e:9"],
              {"PET_NNODES": "2", "PET_NODE_RANK": "0", "MASTER_ADDR": "m"})
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (4, 3, "e", 9)
    # alone: torchrun's defaults
    p = place(["--nproc-per-node=cpu"])
    assert (p.nproc, p.nnodes, p.master_addr, p.master_port, p.run_id) == \
        (2, 1, "127.0.0.1", 29500, "none")
    p = place(["--nproc-per-node=2", "--standalone"])
    assert p.master_addr == "localhost" and p.master_port == 0 and p.run_id != "none"


def test_worker_env_is_torchruns_contract() -> None:
    p = launcher.NodePlace(nproc=4, nnodes=2, node_rank=1, master_addr="m", master_port=5,
                           run_id="r", role="trainer")
    env = launcher.worker_env({"PATH": "/bin"}, p, 2, restart_count=1, max_restarts=3,
                              error_file="/e")
    assert {k: v for k, v in env.items() if k != "PATH"} == {
        "LOCAL_RANK": "2", "RANK": "6", "GROUP_RANK": "1", "ROLE_RANK": "6",
        "ROLE_NAME": "trainer", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8",
        "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "8", "MASTER_ADDR": "m",
        "MASTER_PORT": "5", "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "r",
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_ERROR_FILE": "/e",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1"}
    mine = launcher.worker_env({"OMP_NUM_THREADS": "8"}, p, 0, restart_count=0,
                               max_restarts=0)
    assert mine["OMP_NUM_THREADS"] == "8"  # the user's own setting stays


def test_worker_command_as_torchrun_runs_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    la = LaunchConfig()
    env = {"PATH": "/usr/bin:/bin"}
    assert launcher.worker_command(la, [str(script), "--lr", "1"], env) == \
        (sys.executable, "-u", str(script), "--lr", "1")
    assert launcher.worker_command(la, ["train.py"], env, str(tmp_path)) == \
        (sys.executable, "-u", "train.py")
    assert launcher.worker_command(la, ["python3", "train.py"], env) == ("python3", "train.py")
    assert launcher.worker_command(LaunchConfig(module=True), ["pkg.train", "x"], env) == \
        (sys.executable, "-u", "-m", "pkg.train", "x")
    assert launcher.worker_command(LaunchConfig(no_python=True), ["./run.sh"], env) == \
        ("./run.sh",)
    assert launcher.worker_command(la, ["true"], env) == ("true",)
    assert launcher.worker_command(la, [str(script)], {**env, "PYTHON_EXEC": "/py"})[0] == "/py"
    with pytest.raises(ConfigError, match="script not found: nope.py"):
        launcher.worker_command(la, ["nope.py"], env, str(tmp_path))
    with pytest.raises(ConfigError, match="do not go together"):
        launcher.worker_command(LaunchConfig(module=True, no_python=True), ["m"], env)


def test_tee_maps_and_prefixes() -> None:
    assert [launcher.std_of("3", i) for i in range(2)] == [3, 3]
    assert [launcher.std_of("0:1,2:3", i) for i in range(3)] == [1, 0, 3]
    p = launcher.NodePlace(2, 1, 0, "m", 1, "r")
    assert launcher.line_prefix(p, 1, {}) == b"[default1]:"
    assert launcher.line_prefix(p, 1, {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE":
                                       "[${rank}]:"}) == b"[1]:"
    with pytest.raises(ConfigError, match="is not 0-3"):
        run_cli.parse(["--tee=4", "--", "true"], {})


def test_prefixed_lines_prefix_every_line_once(tmp_path: Path) -> None:
    import os

    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    w = PrefixedLines(fd, b"[default0]:")
    for chunk in (b"a\nb", b"c\n", b"", b"\n", b"d\n"):
        w(chunk)
    os.close(fd)
    assert path.read_bytes() == b"[default0]:a\n[default0]:bc\n[default0]:\n[default0]:d\n"


def test_identity_default_is_unchanged_without_launcher() -> None:
    cfg = run_cli.parse(["--", "true"], {"RANK": "1", "WORLD_SIZE": "2"})
    assert cfg.launch == LaunchConfig() and cfg.identity.rank == 1
    assert isinstance(cfg.identity, IdentityConfig)
