"""``ftagent token --job NAME``: the token that lets agents speak for one job only.

The token is derived from the arbiter's secret (its ``--token``, read here from
``--token`` or FTAGENT_TOKEN) with HMAC-SHA256 over the job's namespace and name, so the
arbiter stores nothing per job: give each job's agents their own token (as their
``--token`` / FTAGENT_TOKEN) instead of the secret. A job token may register ranks of
that job, read it (``ftagent status JOB``) and watch its timeline, nothing else. The
secret itself is the admin credential: every job, every call; keep it for the arbiter
and its operators. Prints the token on stdout (one line, nothing else).

``ftagent token --node NAME`` instead prints a node token for the node agent of NAME
(``ftagent node``): it may only report node-scoped faults for that node, nothing else;
``--node '*'`` makes one for every node, the DaemonSet's single credential.

A job token expires after ``--ttl`` seconds (default 30 days; 0: never). To rotate the
secret, start the arbiter with the new ``--token`` and the old one as ``--previous-token``,
hand out tokens of the new secret, then drop ``--previous-token``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from ftagent.arbiter.auth import ALL_NODES, MIN_SECRET, job_token, node_token
from ftagent.config import ConfigError, OneLineParser, Range, add_group, opt, resolve_group
from ftagent.wire.limits import OutOfRange, check_name

DEFAULT_TTL = 30 * 86400  # a month: long jobs, and a rotation revokes what it must


def _name(v: str) -> str:
    try:
        return check_name("the name", v)
    except OutOfRange as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class TokenConfig:
    """Flags of ``ftagent token`` (each also an FTAGENT_* variable)."""

    job: str = opt("", "--job", "the job the token speaks for (as the agents' --job)",
                   check=_name, metavar="NAME")
    namespace: str = opt("", "--namespace", "the job's namespace, as the agents register "
                         "(their --namespace, else $POD_NAMESPACE; empty when neither)",
                         check=_name, metavar="NS")
    node: str = opt("", "--node", "instead of --job: a node token for the node agent of NODE "
                    "(`ftagent node --node NODE`); '*' for every node", check=_name,
                    metavar="NODE")
    token: str = opt("", "--token", "the arbiter's secret (its --token; prefer the "
                     "FTAGENT_TOKEN variable: flags show in ps)", metavar="SECRET")
    ttl: int = opt(DEFAULT_TTL, "--ttl", "a job token's life in seconds (the arbiter refuses "
                   "it after); 0 never expires", env="FTAGENT_TOKEN_TTL",
                   check=Range(0, 10 * 365 * 86400),
                   metavar="SECONDS")


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="ftagent token", description=__doc__.splitlines()[0])
    add_group(parser, "token", TokenConfig)
    ns = parser.parse_args(argv)
    try:
        cfg = resolve_group(ns, TokenConfig, os.environ)
        if bool(cfg.job) == bool(cfg.node):
            raise ConfigError("one of --job (env FTAGENT_JOB) or --node (env FTAGENT_NODE) "
                              "is required, not both")
        if cfg.node and cfg.namespace:
            raise ConfigError("--namespace is for job tokens; a node token has none")
        if not cfg.token:
            raise ConfigError("no secret: pass the arbiter's --token or set FTAGENT_TOKEN")
    except ConfigError as e:
        sys.stderr.write(f"ftagent token: error: {e}\n")
        return 2
    if len(cfg.token) < MIN_SECRET:
        sys.stderr.write(f"ftagent token: warning: the secret is {len(cfg.token)} characters "
                         f"long; job tokens are only as strong as it is (use {MIN_SECRET} or "
                         "more random characters)\n")
    if cfg.node:
        print(node_token(cfg.token, ALL_NODES if cfg.node == ALL_NODES else cfg.node))
    else:
        expires = int(time.time()) + cfg.ttl if cfg.ttl else None
        if expires is None:
            sys.stderr.write("ftagent token: warning: --ttl 0: this job token never expires; "
                             "only a new secret revokes it\n")
        print(job_token(cfg.token, cfg.namespace, cfg.job, expires))
    return 0
