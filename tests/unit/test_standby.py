"""Which commands a standby can become, and which environment changes rule one out."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ftagent.agent.standby import (
    PythonCommand,
    env_blockers,
    parse_warm_imports,
    python_command,
    warm_restart_parts,
    warmable,
)
from ftagent.agent.worker_parts import WorkerParts


@pytest.fixture
def script(tmp_path: Path) -> str:
    p = tmp_path / "train.py"
    p.write_text("print(1)\n")
    return str(p)


def test_python_script_and_module_commands_are_warmable(script: str) -> None:
    assert python_command(["python3", script, "--lr", "3"], os.environ) == \
        PythonCommand(("python3",), "script", script, 1)
    assert python_command(["/usr/bin/python3.11", "-u", "-X", "dev", "-Wignore", "-OO",
                           script], os.environ) == \
        PythonCommand(("/usr/bin/python3.11", "-u", "-X", "dev", "-Wignore", "-OO"),
                      "script", script, 6)
    assert python_command(["python", "-B", "-m", "pkg.train", "--x"], os.environ) == \
        PythonCommand(("python", "-B"), "module", "pkg.train", 2)


@pytest.mark.parametrize("argv", [
    ["python", "-c", "print(1)"], ["python", "-i", "x.py"], ["python", "-x", "x.py"],
    ["python", "-"], ["python"], ["python", "--version"], ["python", "-mpkg"],
    ["python", "-m"], ["python", "-m", "not a module"], ["python", "/nonexistent.py"],
    ["sh", "-c", "python x.py"], ["torchrun", "train.py"], [],
])
def test_other_commands_start_cold(argv: list[str]) -> None:
    assert python_command(argv, os.environ) is None


@pytest.mark.parametrize("argv", [
    ["python", "-c", "print(1)"], ["python", "-i", "x.py"], ["python", "-"], ["python"],
    ["python", "-m", "not a module"], ["sh", "-c", "python x.py"], ["torchrun", "train.py"],
    [],
])
def test_a_command_no_standby_can_become_is_known_before_any_file_is_read(
        argv: list[str]) -> None:
    """``warmable``: what never changes about a command. False: ``python_command`` says
    None whatever the files (the starter is chosen cold once)."""
    assert not warmable(argv)
    assert python_command(argv, os.environ) is None


def test_a_command_whose_files_decide_stays_warmable(tmp_path: Path) -> None:
    """The script or the shebang is read when each standby is prepared, not here: a
    script missing now may be there by the next restart."""
    assert warmable(["python3", str(tmp_path / "later.py")])
    assert python_command(["python3", str(tmp_path / "later.py")], os.environ) is None
    assert warmable(["python", "-u", "-m", "pkg.train"])
    assert warmable([str(tmp_path / "run.py")])  # its shebang decides, later


def _wiring(command: list[str], *, warm: bool = True, max_restarts: int = 3) -> object:
    from ftagent.cmd.run import parse

    flags = ["--metrics-port", "-1", "--max-restarts", str(max_restarts)]
    flags += [] if warm else ["--no-warm-restart"]
    return parse([*flags, "--", *command], {})


@pytest.mark.parametrize("cfg_args", [
    (["python", "-c", "print(1)"], True, 3),  # no standby can become it
    (["python3", "train.py"], False, 3),  # --no-warm-restart
    (["python3", "train.py"], True, 0),  # no restart can follow: nobody would use one
])
def test_a_worker_that_can_never_be_warm_gets_no_warm_starter(
        cfg_args: tuple[list[str], bool, int]) -> None:
    """The starter is chosen once, at wiring: such a worker's spawn is the cold one, with
    no warm starter consulted (and falling back) at each start, and none of its parts."""
    command, warm, max_restarts = cfg_args
    cfg = _wiring(command, warm=warm, max_restarts=max_restarts)
    parts = WorkerParts()
    assert warm_restart_parts(object(), cfg, "/nonexistent", parts) is parts


def test_a_worker_that_may_be_warm_starts_through_its_warm_starter() -> None:
    from types import SimpleNamespace

    cfg = _wiring(["python3", "train.py"])
    worker = SimpleNamespace(events=SimpleNamespace(write=lambda *a, **k: None),
                             restarts=0, metrics=None)
    parts = warm_restart_parts(worker, cfg, "/nonexistent", WorkerParts())
    assert parts.spawn.keywords["starter"] is not None  # type: ignore[attr-defined]
    assert [h.__name__ for h in parts.before_start] == ["store_first"]


def test_an_executable_script_with_a_python_shebang(tmp_path: Path) -> None:
    direct = tmp_path / "a.py"
    direct.write_text("#!/usr/bin/python3 -u\nprint(1)\n")
    via_env = tmp_path / "b.py"
    via_env.write_text("#!/usr/bin/env python3\nprint(1)\n")
    shell = tmp_path / "c.py"
    shell.write_text("#!/bin/sh\necho 1\n")
    for p in (direct, via_env, shell):
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    assert python_command([str(direct), "x"], os.environ) == \
        PythonCommand(("/usr/bin/python3", "-u"), "script", str(direct), 0)
    assert python_command([str(via_env)], os.environ) == \
        PythonCommand(("/usr/bin/env", "python3"), "script", str(via_env), 0)
    assert python_command([str(shell)], os.environ) is None
    # found on PATH like execvp would: argv[0] of the trainer is the full path
    assert python_command(["a.py"], {"PATH": str(tmp_path)}) == \
        PythonCommand(("/usr/bin/python3", "-u"), "script", str(direct), 0)
    direct.chmod(0o644)  # not executable: the cold start reports it (126)
    assert python_command([str(direct)], os.environ) is None


def test_only_per_attempt_variables_may_change() -> None:
    old = {"PATH": "/bin", "FTAGENT_GENERATION": "1", "RANK": "0", "OMP_NUM_THREADS": "1"}
    new = dict(old, FTAGENT_GENERATION="2", TORCHELASTIC_RESTART_COUNT="1", MASTER_PORT="9")
    assert env_blockers(old, new) == []
    assert env_blockers(old, dict(new, OMP_NUM_THREADS="4", PYTHONPATH="/x")) == \
        ["OMP_NUM_THREADS", "PYTHONPATH"]
    gone = dict(new)
    del gone["PATH"]
    assert env_blockers(old, gone) == ["PATH"]


def test_warm_imports_are_split_deduplicated_and_checked() -> None:
    assert parse_warm_imports(["torch,transformers", " torch , numpy.linalg", ""]) == \
        ("torch", "transformers", "numpy.linalg")
    with pytest.raises(ValueError, match="not a module name"):
        parse_warm_imports(["torch,1bad"])
