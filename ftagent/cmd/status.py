"""``ftagent status [JOB]``: jobs, ranks and timelines from the arbiter.

Without JOB: one line per job on every replica. With JOB: its ranks (state, step, age
of the last step, restarts, generation, last fault) and its timeline, asked from the
replica that owns the job (the agents' own shard choice). ``--json`` prints the API's
answer for machines; ``--follow`` streams the timeline as it happens. Jobs whose agents
have all left stay listed, from the arbiter's history, for its --history-retention:
their state says how they ended ("succeeded", "stopped: REASON", "gone: no agent for
Ns").
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

import grpc

from ftagent.arbiter.status_view import (
    StatusError,
    _call,
    _stub,
    format_entry,
    format_job,
    format_jobs,
    to_dict,
)
from ftagent.config import (
    CONNECTION_FIELDS,
    ArbiterClientConfig,
    ConfigError,
    HelpFormatter,
    OneLineParser,
    StatusConfig,
    add_group,
    name,
    resolve_group,
    shown,
)
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.credentials import bearer, current_token
from ftagent.wire.shard import pick_arbiter


def kubeconfig_token() -> str:
    """The bearer token of the kubeconfig's current context ($KUBECONFIG, else
    ~/.kube/config), as the ``kubernetes`` client resolves it (token, tokenFile, exec
    plugin, OIDC id-token); ConfigError when there is none."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ConfigError("--kube-credentials needs the kubernetes client: pip install "
                          "'ftagent[arbiter]'") from None
    conf = client.Configuration()
    try:
        config.load_kube_config(client_configuration=conf)
    except Exception as e:  # no file, no context, an exec plugin that failed
        raise ConfigError(f"--kube-credentials: cannot read the kubeconfig: "
                          f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
                          ) from None
    value = str((conf.api_key or {}).get("BearerToken") or "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ConfigError("--kube-credentials: the kubeconfig's current user has no bearer "
                          "token (client certificates and basic auth cannot be presented to "
                          "the arbiter)")
    return token.strip()


def credential(cfg: ArbiterClientConfig, kube_credentials: bool) -> str:
    """What ``ftagent status`` presents: --token / --token-file, or with
    --kube-credentials the user's own Kubernetes token."""
    if kube_credentials:
        if cfg.token or cfg.token_file:
            raise ConfigError("--kube-credentials and --token/--token-file: give one")
        return kubeconfig_token()
    return current_token(cfg.token, cfg.token_file)


def _follow(cfg: ArbiterClientConfig, address: str, job: str, namespace: str,
            as_json: bool, token: str) -> int:
    stub = _stub(cfg, address)
    req = pb.WatchEventsRequest(job=job, namespace=namespace, replay=True)
    try:
        for e in stub.WatchEvents(req, metadata=bearer(token)):
            print(json.dumps(to_dict(e)) if as_json else format_entry(e), flush=True)
    except KeyboardInterrupt:
        return 0
    except grpc.RpcError as e:
        raise StatusError(f"{address}: {e.code().name}: {e.details()}") from None
    return 0


def run(cfg: ArbiterClientConfig, job: str, namespace: str, as_json: bool, follow: bool,
        limit: int, kube_credentials: bool = False) -> int:
    if not cfg.arbiter:
        raise ConfigError("no arbiter: pass --arbiter HOST:PORT or set FTAGENT_ARBITER")
    replicas = [a.strip() for a in cfg.arbiter.split(",") if a.strip()]
    token = credential(cfg, kube_credentials)
    if job:
        address = pick_arbiter(replicas, job)
        if follow:
            return _follow(cfg, address, job, namespace, as_json, token)
        stub = _stub(cfg, address)
        info = _call(address, stub.GetJob, pb.GetJobRequest(
            job=job, namespace=namespace, timeline_limit=limit), token)
        print(json.dumps(to_dict(info), indent=2) if as_json else format_job(info))
        return 0
    if follow:
        if len(replicas) > 1:
            raise StatusError("--follow without JOB needs a single --arbiter address")
        return _follow(cfg, replicas[0], "", namespace, as_json, token)
    jobs: list[pb.JobInfo] = []
    for address in replicas:
        got = _call(address, _stub(cfg, address).ListJobs, pb.ListJobsRequest(), token)
        jobs += [j for j in got.jobs if not namespace or j.namespace == namespace]
    if as_json:
        print(json.dumps({"jobs": [to_dict(j) for j in jobs]}, indent=2))
    else:
        print(format_jobs(jobs))
    return 0


EPILOG = """\
exit status: 0; 1 when the arbiter cannot be reached or refuses the call; 2 for a bad
  flag or value. Errors are one line on stderr.

examples:
  FTAGENT_ARBITER=arbiter:9400 ftagent status                 # every job
  ftagent status --arbiter arbiter:9400 llama --follow         # one job's timeline, live
  ftagent status --arbiter a:9400,b:9400 llama --json | jq .ranks
  ftagent status --arbiter arbiter:9400 --kube-credentials -n team llama   # your own RBAC
"""


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="ftagent status", description=__doc__.splitlines()[0],
                           epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("job", nargs="?", default="", metavar="JOB",
                        help="show this job's ranks and timeline")
    add_group(parser, "jobs and output", StatusConfig)
    add_group(parser, "arbiter connection", ArbiterClientConfig, only=CONNECTION_FIELDS)
    return parser


def parse(argv: list[str], environ: Mapping[str, str]) -> tuple[
        str, StatusConfig, ArbiterClientConfig]:
    """Flags + environment -> (JOB, output options, connection); raises ConfigError."""
    ns = build_parser().parse_args(argv)
    job = str(ns.job)
    if job:
        try:
            name(job)
        except ConfigError as e:
            raise ConfigError(f"JOB {shown(job)} {e}") from None
    return (job, resolve_group(ns, StatusConfig, environ),
            resolve_group(ns, ArbiterClientConfig, environ, only=CONNECTION_FIELDS))


def main(argv: list[str]) -> int:
    try:
        job, opts, cfg = parse(argv, os.environ)
        return run(cfg, job, opts.namespace, opts.json, opts.follow, opts.timeline,
                   opts.kube_credentials)
    except (ConfigError, ValueError) as e:
        sys.stderr.write(f"ftagent status: error: {e} (see ftagent status --help)\n")
        return 2
    except StatusError as e:
        sys.stderr.write(f"ftagent status: error: {e}\n")
        return 1
