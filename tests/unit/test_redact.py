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
