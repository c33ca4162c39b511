"""A trainer that floods step-like lines: its output passes through untouched, its own
exit status wins, no false hang, and the lines the agent could not parse are counted."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import PY, free_port, ftagent_cmd, read_events, wait_for

FINAL_STEP = 400


def hostile_payload() -> bytes:
    """~120 MB: every line is step-like for some parser (varied numbers, 4,400-digit and
    above-int64 steps, tqdm ``\\r`` bars, 8 KB lines of digits); real progress every block."""
    digits = "".join(str((i * 7919) % 10) for i in range(4400))
    parts = []
    for s in range(1, FINAL_STEP + 1):
        block = []
        for i in range(60):
            n = s * 100 + i
            block += [
                f"iteration {n % 97:8d}/{n + 9} | consumed samples: {n * 32} | lm loss: 1.{i} |",
                f"{{'loss': 1.{i}, 'grad_norm': 0.{n}, 'epoch': 0.{i}, 'step': {i}}}",
                f" {i % 100:2d}%|####      | {i}/60 [00:01<00:02, 3.{i}it/s, loss=0.{n}]\r",
                f"step={digits} loss=0.5 step={2**63 + n} loss=0.{i}",
                f"Epoch[{i}] Batch [{n}]\tSpeed: {n}.5 samples/sec\taccuracy=0.{i}",
            ]
            if i % 20 == 0:
                block.append(("step " + digits[:200] + " %| " + digits[:200] + " loss ") * 20)
        block.append(f"step={s * 1_000_000} loss=0.{s} samples_per_second=12.5")
        parts.append("\n".join(block) + "\n")
    return "".join(parts).replace("\r\n", "\r").encode()


@pytest.fixture(scope="module")
def payload(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    """The payload and a file holding it: built once for the module (~120 MB)."""
    data = hostile_payload()
    path = tmp_path_factory.mktemp("hostile") / "hostile.log"
    path.write_bytes(data)
    return data, path


def trainer(payload: Path, then: str) -> list[str]:
    code = (
        "import sys\n"
        f"data = open({str(payload)!r}, 'rb').read()\n"
        "for i in range(0, len(data), 1 << 16):\n"
        "    sys.stdout.buffer.write(data[i:i + (1 << 16)])\n"
        "sys.stdout.flush()\n"
        f"{then}\n"
        "sys.exit(42)\n"
    )
    return [PY, "-c", code]


def test_flood_then_exit_42_passes_42_through_with_no_hang(
        tmp_path: Path, payload: tuple[bytes, Path]) -> None:
    data, path = payload
    events = tmp_path / "ev.jsonl"
    # a 1 s hang budget: a loop that ran 1 s behind and judged on stale data would hang
    r = subprocess.run(
        ftagent_cmd("--log-level", "warning", "--events-file", str(events), "--max-restarts",
                    "0", "--hang-timeout-min", "1", "--hang-warmup-steps", "1",
                    cmd=trainer(path, "")),
        capture_output=True, timeout=300)
    assert r.returncode == 42, r.stderr[-2000:]
    assert r.stdout == data
    evs = read_events(events)
    assert not [e for e in evs if e.get("event") == "fault" and e.get("kind") == "hang"], evs
    assert [e for e in evs if e.get("event") == "exit"][-1]["exit_status"] == 42
    assert b"Traceback" not in r.stderr  # 4,400 digits, steps above int64: no step, silently


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith("ftagent_") and " " in ln:
            name, _, value = ln.rpartition(" ")
            key = name.split("{")[0]
            if "reason=" in name:
                key += "/" + name.split('reason="')[1].split('"')[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def test_lines_not_parsed_are_counted_and_the_last_step_is_seen(
        payload: tuple[bytes, Path]) -> None:
    data, path = payload
    lines = data.replace(b"\r", b"\n").count(b"\n")
    port = free_port()
    proc = subprocess.Popen(
        ftagent_cmd("--log-level", "warning", f"--metrics-port={port}", "--metrics-addr",
                    "127.0.0.1", "--hang-timeout-min", "300",
                    cmd=trainer(path, "sys.stdin.read()")),
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        m = wait_for(lambda: (s := scrape_or_none(port)) and
                     s.get("ftagent_training_step") == FINAL_STEP * 1_000_000 and s,
                     timeout=120, what="the last step on /metrics")
        skipped = {k.split("/")[1]: v for k, v in m.items()
                   if k.startswith("ftagent_log_lines_skipped_total/")}
        assert set(skipped) <= {"backlog", "budget", "too_long", "error"}
        assert skipped.get("error", 0) == 0  # huge numbers are no step, not parser errors
        assert 0 <= sum(skipped.values()) <= lines
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        rc = proc.wait(timeout=60)
    assert rc == 42


def scrape_or_none(port: int) -> dict[str, float] | None:
    try:
        return scrape(port)
    except OSError:
        return None
