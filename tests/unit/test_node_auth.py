"""Node tokens: what a node agent's credentials may do (pure, no server)."""

from __future__ import annotations

import asyncio

from ftagent.arbiter import auth
from ftagent.arbiter.auth import (
    ALL_NODES,
    Presented,
    Principal,
    authorize,
    authorize_node,
    job_token,
    node_token,
    parse_node_token,
)
from ftagent.cmd.token import main as token_main

SECRET = "a-secret-of-enough-length"


def who(bearer: str) -> Principal | None:
    return asyncio.run(auth.authenticator_for(SECRET, "").authenticate(Presented(bearer)))


def test_a_node_token_reports_for_its_node_only_and_reads_nothing() -> None:
    p = who(node_token(SECRET, "gpu-node-7"))
    assert p is not None and p.node == "gpu-node-7" and not p.admin
    assert authorize_node(p, "gpu-node-7") and not authorize_node(p, "gpu-node-8")
    assert not authorize(p, "", "llama") and not authorize(p, "ml", "llama")
    assert p.scope() == "the reports of node 'gpu-node-7'"


def test_the_every_node_token_and_the_admin() -> None:
    p = who(node_token(SECRET, ALL_NODES))
    assert p is not None and authorize_node(p, "any") and not authorize(p, "", "job")
    admin = who(SECRET)
    assert admin is not None and authorize_node(admin, "n1")


def test_job_tokens_and_forgeries_cannot_report_for_a_node() -> None:
    job = who(job_token(SECRET, "", "llama"))
    assert job is not None and not authorize_node(job, "n1")
    other = node_token("another-secret-entirely", "n1")
    assert who(other) is None
    node, mac = parse_node_token(node_token(SECRET, "n1")) or ("", b"")
    forged = ".".join(("ftn1", auth._b64(b"n2"), auth._b64(mac)))
    assert who(forged) is None, "a node's mac does not work for another node"
    for bad in ("ftn1", "ftn1.x.y", "ftn1..", "ftn1.bjE.!!!", "ftj1.bjE.bjE"):
        assert parse_node_token(bad) is None


def test_job_and_node_token_macs_never_coincide() -> None:
    # a job token "ftj1.<ns>.<job>.<mac>" cannot be cut into a node token and vice versa
    assert node_token(SECRET, "n1").split(".")[-1] != job_token(SECRET, "", "n1").split(".")[-1]


def test_token_cli_prints_node_tokens(capsys: object) -> None:
    import os

    os.environ["FTAGENT_TOKEN"] = SECRET
    try:
        assert token_main(["--node", "n1"]) == 0
        assert token_main(["--node", "n1", "--job", "j"]) == 2
        assert token_main(["--node", "n1", "--namespace", "ml"]) == 2
        assert token_main([]) == 2
    finally:
        del os.environ["FTAGENT_TOKEN"]
    out = capsys.readouterr()  # type: ignore[attr-defined]
    assert out.out.strip() == node_token(SECRET, "n1")
    assert "one of --job" in out.err and "--namespace is for job tokens" in out.err
