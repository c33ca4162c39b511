"""Issue 21's CLI nits: no ``--no-no-python`` in any help, forgetting ``--`` says what to
do, and ``--tee`` prefixes go out as whole lines when workers share a console."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ftagent import cli
from ftagent.agent.tee import PrefixedLines, WorkerOutput
from ftagent.cmd import arbiter as arbiter_cli
from ftagent.cmd import node as node_cli
from ftagent.cmd import run as run_cli
from ftagent.cmd import status as status_cli
from ftagent.cmd import webhook as webhook_cli
from ftagent.config import ConfigError

PARSERS = {"run": run_cli.build_parser, "arbiter": arbiter_cli.build_parser,
           "node": node_cli.build_parser, "webhook": webhook_cli.build_parser,
           "status": status_cli.build_parser}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_help_never_negates_a_negation(command: str) -> None:
    text = PARSERS[command]().format_help()
    assert "--no-no-" not in text, command


def test_no_python_is_one_flag_that_sets_it() -> None:
    text = run_cli.build_parser().format_help()
    assert "--no-python " in text and "--no-no-python" not in text
    cfg = run_cli.parse(["--nproc-per-node", "2", "--no-python", "--", "true"], {})
    assert cfg.launch.no_python is True
    assert run_cli.parse(["--", "true"], {}).launch.no_python is False
    assert run_cli.parse(["--", "true"], {"FTAGENT_NO_PYTHON": "1"}).launch.no_python is True


def test_command_without_the_separator_says_where_it_goes() -> None:
    with pytest.raises(ConfigError) as e:
        run_cli.parse(["--max-restarts", "3", "python", "train.py", "--lr", "3e-4"], {})
    assert str(e.value) == ("unrecognized arguments: python train.py --lr 3e-4; put the "
                            "command after --: ftagent run [flags] -- python train.py "
                            "--lr 3e-4")
    # an unknown flag is only that: no advice about a command
    with pytest.raises(ConfigError, match=r"^unrecognized arguments: --bogus$"):
        run_cli.parse(["--bogus", "--", "true"], {})


def test_main_prints_the_hint_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli.main(["python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "put the command after --: ftagent run [flags] -- python train.py" in err
    assert cli.main(["python", "train.py"]) == 2
    assert "ftagent run [flags] -- CMD" in capsys.readouterr().err


def test_prefixed_partial_lines_of_two_workers_do_not_interleave(tmp_path: Path) -> None:
    """The race of --tee 3, made deterministic: worker 0's line arrives in two reads and
    worker 1's whole line between them. Before, the console read
    ``[default0]:step 1 lo[default1]:step 1 loss 2.0\\nss 2.5\\n``."""
    path = tmp_path / "console"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    lock = threading.Lock()
    w0, w1 = PrefixedLines(fd, b"[default0]:", lock), PrefixedLines(fd, b"[default1]:", lock)
    w0(b"step 1 lo")
    w1(b"step 1 loss 2.0\n")
    w0(b"ss 2.5\nstep 2")
    w1(b"step 2 loss 1.9\nno newline at exit")
    w0(b" loss 2.4\n")
    w1.flush()  # ended with the newline it lacked: the next line is not glued to it
    w0.flush()  # nothing held: writes nothing
    os.close(fd)
    assert path.read_bytes().splitlines() == [
        b"[default1]:step 1 loss 2.0", b"[default0]:step 1 loss 2.5",
        b"[default1]:step 2 loss 1.9", b"[default0]:step 2 loss 2.4",
        b"[default1]:no newline at exit"]
    assert path.read_bytes().endswith(b"exit\n")


def test_an_overlong_line_without_newline_is_not_held_forever(tmp_path: Path) -> None:
    path = tmp_path / "console"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    w = PrefixedLines(fd, b"[r0]:", max_line=8)
    w(b"0123456789")  # past max_line: written, prefixed once
    w(b"ab\nnext\n")
    os.close(fd)
    assert path.read_bytes() == b"[r0]:0123456789ab\n[r0]:next\n"


def test_worker_output_close_writes_the_held_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "console"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    out = WorkerOutput(fd, b"[default0]:", None, threading.Lock())
    out(b"done")
    assert path.read_bytes() == b""  # held until its end
    out.close()
    os.close(fd)
    assert path.read_bytes() == b"[default0]:done\n"  # ended: the console is shared
