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
)


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
