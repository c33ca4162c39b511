"""Compatibility credentials off in the cluster (issue 33.6). With ``--kube`` the
arbiter's chain (cmd/arbiter.kube_authenticator) refuses what ``--token`` derives that a
leak makes dangerous in a shared cluster: a never-expiring ftj1 job token (it squatted a
rank forever) and the every-node ``*`` node token (it replaced ranks and cordoned any node);
``--allow-legacy-tokens`` (FTAGENT_ALLOW_LEGACY_TOKENS) accepts them again. ``--kube
--insecure`` says in ``--help`` and at start-up that a caller with no token is the admin.
On the code before, both tokens were accepted and neither text existed."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("kubernetes")

from ftagent.arbiter.auth import Presented, Principal, job_token, node_token  # noqa: E402
from ftagent.cmd.arbiter import (  # noqa: E402
    build_parser,
    kube_authenticator,
    parse,
    tokenless_admin,
)

SECRET = "cluster-secret-0123456789"


def _who(args: list[str], token: str | None, env: dict[str, str] | None = None
         ) -> Principal | None:
    cfg = parse(["--kube", "--token", SECRET, *args], env or {})
    chain = kube_authenticator(cfg, None)  # no API call: none of these is a JWT
    return asyncio.run(chain.authenticate(Presented(token)))


def test_unexpiring_job_tokens_and_the_every_node_token_are_refused_in_the_cluster() -> None:
    ftj1 = job_token(SECRET, "team", "train")
    ftj2 = job_token(SECRET, "team", "train", expires=int(time.time()) + 3600)
    every, one = node_token(SECRET, "*"), node_token(SECRET, "n1")
    assert _who([], ftj1) is None
    assert _who([], every) is None
    got = _who([], ftj2)
    assert got is not None and got.job == "train"
    got = _who([], one)
    assert got is not None and got.node == "n1"
    assert _who([], SECRET) is not None  # the secret itself stays the admin
    for args, env in ((["--allow-legacy-tokens"], {}),
                      ([], {"FTAGENT_ALLOW_LEGACY_TOKENS": "1"})):
        got = _who(args, ftj1, env)
        assert got is not None and got.job == "train"
        got = _who(args, every, env)
        assert got is not None and got.node == "*"


def test_insecure_says_a_tokenless_caller_is_the_admin() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--allow-legacy-tokens" in text
    assert "a caller that presents no token at all is the ADMIN" in text
    line = tokenless_admin(parse(["--kube", "--insecure", "--listen", "0.0.0.0:9400"], {}))
    assert "no token at all is the ADMIN" in line and "\n" not in line
    assert "admin" in tokenless_admin(parse(["--kube", "--listen", "127.0.0.1:9400"], {}))
    assert tokenless_admin(parse(["--kube", "--insecure", "--token", SECRET], {})) == ""
    assert tokenless_admin(parse(["--insecure", "--listen", "0.0.0.0:9400"], {})) == ""
    # and such a chain does make a tokenless caller the admin (what the line warns of)
    cfg = parse(["--kube", "--insecure", "--listen", "0.0.0.0:9400"], {})
    anyone = asyncio.run(kube_authenticator(cfg, None).authenticate(Presented(None)))
    assert anyone is not None and anyone.admin
