"""HMAC job tokens outside Kubernetes: an expiry inside the MAC, and secret rotation (the
old and the new secret accepted while ``--previous-token`` is set). On the code before, a
job token never expired and a new secret cut every agent off at once."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time

from ftagent.arbiter.auth import (
    JobTokens,
    NodeTokens,
    Presented,
    Secret,
    job_token,
    node_token,
    parse_expiring_token,
)
from ftagent.cmd import token as token_cli

NEW, OLD = "new-secret-0123456789", "old-secret-0123456789"


def auth(a: object, token: str) -> object:
    return asyncio.run(a.authenticate(Presented(token)))  # type: ignore[attr-defined]


def test_an_expiring_token_is_refused_from_its_expiry_on() -> None:
    now = [1_000_000.0]
    tokens = JobTokens(NEW, clock=lambda: now[0])
    t = job_token(NEW, "ml", "train", expires=1_000_060)
    assert t.startswith("ftj2.")
    p = auth(tokens, t)
    assert p is not None and p.job == "train"  # type: ignore[attr-defined]
    now[0] = 1_000_060.0
    assert auth(tokens, t) is None
    # a later expiry written into the token breaks its MAC
    head, ns, job, _exp, mac = t.split(".")
    forged = ".".join((head, ns, job, "MTk5OTk5OTk5OQ", mac))  # "1999999999"
    now[0] = 1_000_000.0
    assert parse_expiring_token(forged) is not None and auth(tokens, forged) is None


def test_rotation_accepts_both_secrets_until_the_old_one_is_dropped() -> None:
    old_job, old_node = job_token(OLD, "", "train"), node_token(OLD, "n1")
    both = (NEW, OLD)
    assert auth(JobTokens(both), old_job) is not None
    assert auth(NodeTokens(both), old_node) is not None
    assert auth(Secret(both), OLD) is not None
    assert auth(JobTokens(both), job_token(NEW, "", "train")) is not None
    assert auth(JobTokens(NEW), old_job) is None  # the window closed
    assert auth(Secret(NEW), OLD) is None


def test_ftagent_token_ttl_round_trip() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert token_cli.main(["--job", "train", "--token", NEW, "--ttl", "120"]) == 0
    parsed = parse_expiring_token(out.getvalue().strip())
    assert parsed is not None and abs(parsed[2] - (time.time() + 120)) < 5
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert token_cli.main(["--job", "train", "--token", NEW, "--ttl", "0"]) == 0
    assert out.getvalue().startswith("ftj1.")
