"""Output passes through byte for byte, whatever the trainer writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import PY, ftagent_cmd

ODD = (
    b"partial line without newline"
    + b"\nprogress 10%\rprogress 50%\rprogress 100%\n"
    + b"invalid utf-8: \xff\xfe\xc3\x28 end\n"
    + b"\x1b[31mANSI red\x1b[0m\n"
    + b"\x00NUL bytes\x00\n"
    + b"x" * (10 * 1024 * 1024)  # a 10 MB line without a newline
    + b"\r\n\r\n"
    + b"tail without newline"
)


def test_stdout_and_stderr_are_byte_exact(tmp_path: Path) -> None:
    payload = tmp_path / "payload.bin"
    payload.write_bytes(ODD)
    writer = (
        "import sys\n"
        f"data = open({str(payload)!r}, 'rb').read()\n"
        "for i in range(0, len(data), 777):\n"  # odd-sized writes, interleaved flushes
        "    sys.stdout.buffer.write(data[i:i+777]); sys.stdout.flush()\n"
        "sys.stderr.buffer.write(data[::-1]); sys.stderr.flush()\n"
    )
    r = subprocess.run(ftagent_cmd("--log-level", "error", cmd=[PY, "-c", writer]),
                       capture_output=True, timeout=120)
    assert r.returncode == 0
    assert r.stdout == ODD
    assert r.stderr == ODD[::-1]


def test_last_lines_are_bounded_and_cut_long_lines(tmp_path: Path) -> None:
    events = tmp_path / "ev.jsonl"
    code = "import sys; sys.stdout.write('y' * 300000 + '\\n' + 'short\\n'); sys.exit(1)"
    r = subprocess.run(ftagent_cmd("--log-lines", "5", "--events-file", str(events),
                                   cmd=[PY, "-c", code]), capture_output=True, timeout=60)
    assert r.returncode == 1
    import json

    fault = [json.loads(x) for x in events.read_text().splitlines()
             if '"fault"' in x][0]
    assert fault["last_lines"][-1] == "short"
    assert len(fault["last_lines"][0]) == 1 << 16  # capped for detection, not for output
    assert len(r.stdout) == 300000 + 1 + 6
