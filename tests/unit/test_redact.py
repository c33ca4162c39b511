"""Secrets out of evidence (agent/redact.py). The shapes of issue 33 ("Redaction misses
``--token X``, ``Authorization: Bearer``, URL passwords") were kept verbatim before."""

from __future__ import annotations

import time

import pytest

from ftagent.agent.evidence import redact_secrets
from ftagent.agent.redact import REDACTED, redact_argv

R = REDACTED


@pytest.mark.parametrize(("line", "want"), [
    ("run --token s3cr3t --lr 3", f"run --token {R} --lr 3"),
    ("--password 'hunter 2' x", f"--password {R} x"),
    ("--api-key=abc --hf-token abc", f"--api-key={R} --hf-token {R}"),
    ("curl -H 'Authorization: Bearer eyJhbGciOi.abc.def'",
     f"curl -H 'Authorization: Bearer {R}'"),
    ('{"authorization": "Basic dXNlcjpwYXNz"}', f'{{"authorization": "Basic {R}"}}'),
    ("Authorization:abc123", f"Authorization:{R}"),
    ("got bearer abcdefgh12345 from vault", f"got bearer {R} from vault"),
    ("clone https://alice:pa55w0rd@git.example.com/x.git",
     f"clone https://alice:{R}@git.example.com/x.git"),
    ("postgresql://u:p%40ss@db:5432/x", f"postgresql://u:{R}@db:5432/x"),
    ("HF_TOKEN=hf_x WORLD_SIZE=2", f"HF_TOKEN={R} WORLD_SIZE=2"),
])
def test_common_secret_shapes_are_redacted(line: str, want: str) -> None:
    assert redact_secrets(line) == want


@pytest.mark.parametrize("line", [
    "--token-file /var/run/secrets/token --nproc-per-node 8",
    "step 10 loss 2.3 --max-tokens 4096",
    "https://example.com/path@v2 and http://host:8080/x",
    "a bearer of bad news",
])
def test_ordinary_lines_are_kept(line: str) -> None:
    assert redact_secrets(line) == line


def test_an_argv_flag_and_its_value_in_two_words() -> None:
    argv = ["python", "train.py", "--token", "s3cr3t", "--wandb-key", "k", "--lr", "3",
            "--token-file", "/t", "--password=x"]
    assert redact_argv(argv) == ["python", "train.py", "--token", R, "--wandb-key", R,
                                 "--lr", "3", "--token-file", "/t", f"--password={R}"]


def test_hostile_lines_take_linear_time() -> None:
    for line in ("-" * 60000 + "x", "--token " + " " * 60000, "a://" + "b" * 300 + ":" * 60000,
                 "authorization" * 5000, "bearer " * 9000, "x=" * 30000):
        start = time.perf_counter()
        redact_secrets(line)
        assert time.perf_counter() - start < 1.0, line[:30]


def test_a_tail_is_redacted_in_one_call_line_by_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The evidence's last lines (worker_evidence.tail): each line redacted as alone, the
    stderr ones marked in a merged tail, through one ``redact_lines`` call per tail."""
    from ftagent.agent import worker_evidence
    from ftagent.agent.redact import redact_lines
    from ftagent.agent.tee import LastLines

    lines = ["run --token s3cr3t", "HF_TOKEN=hf_x WORLD_SIZE=2", "step 3 loss 1.0"]
    assert redact_lines(lines) == [redact_secrets(line) for line in lines]
    ring = LastLines(10)
    ring.add("stdout", b"run --token s3cr3t\nstep 3 loss 1.0\n")
    ring.add("stderr", b"HF_TOKEN=hf_x WORLD_SIZE=2\n")
    calls: list[int] = []
    real = worker_evidence.redact_lines

    def counted(got: list[str]) -> list[str]:
        calls.append(len(got))
        return real(got)

    monkeypatch.setattr(worker_evidence, "redact_lines", counted)
    merged = worker_evidence.tail(ring)
    stderr = worker_evidence.tail(ring, stream="stderr")
    assert merged == [f"run --token {R}", "step 3 loss 1.0", f"stderr: HF_TOKEN={R} WORLD_SIZE=2"]
    assert stderr == [f"HF_TOKEN={R} WORLD_SIZE=2"]
    assert calls == [3, 1]  # one call per tail, not one per line
