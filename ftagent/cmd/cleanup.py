"""``ftagent cleanup``: after an uninstall, take off the Nodes what ftagent wrote on them.

``kubectl delete -k deploy/`` removes what it created, not what ftagent wrote onto Nodes:
the ``ftagent.io/fault`` taint, the ``ftagent.io/cordoned`` label and the ``ftagent.io/*``
annotations of a node the arbiter cordoned, and the node agent's ``FtagentGPUHealthy`` /
``FtagentNICHealthy`` conditions. Run this after it, with your own credentials (update
nodes, patch nodes/status, list pods): it refuses while an arbiter or a node agent still
runs (they would write them again; --force to go on anyway). A node ftagent cordoned
stays cordoned unless --uncordon: it had node-scope evidence against it, and the line
printed for it says what (the annotations that said so are gone afterwards). One line per
node changed on stdout; exit 0 when every node is clean, 1 when a node could not be
cleaned, 2 for bad flags or no way to reach the API server.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ftagent.config import (
    ConfigError,
    HelpFormatter,
    OneLineParser,
    add_group,
    opt,
    resolve_group,
)

PROG = "ftagent cleanup"
EPILOG = """\
examples:
  kubectl delete -k deploy/ && ftagent cleanup --dry-run      # what would change
  ftagent cleanup                                             # your kubeconfig's cluster
  ftagent cleanup --uncordon --kubeconfig ~/.kube/prod        # also uncordon ftagent's cordons
"""


@dataclass(frozen=True)
class CleanupConfig:
    """Flags of ``ftagent cleanup`` (each also an FTAGENT_* variable)."""

    kube_api: str = opt("", "--kube-api", "Kubernetes API server URL (e.g. "
                        "http://127.0.0.1:8001 behind kubectl proxy); empty: in-cluster "
                        "config, else --kubeconfig", metavar="URL")
    kubeconfig: str = opt("", "--kubeconfig", "kubeconfig file (default: $KUBECONFIG, "
                          "else ~/.kube/config)", metavar="PATH")
    dry_run: bool = opt(False, "--dry-run", "say what would change, change nothing")
    uncordon: bool = opt(False, "--uncordon", "also uncordon the nodes ftagent cordoned "
                         "(only those: its cordoned-by annotation)")
    force: bool = opt(False, "--force", "go on although ftagent's arbiter or node agents "
                      "still run (they may mark nodes again)")


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                           epilog=EPILOG, formatter_class=HelpFormatter)
    add_group(parser, "cleanup", CleanupConfig)
    return parser


def main(argv: list[str]) -> int:
    try:
        cfg = resolve_group(build_parser().parse_args(argv), CleanupConfig, os.environ)
    except ConfigError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    from ftagent.kube.client import KubeConfigError, api_client

    try:
        client = api_client(cfg.kube_api or None, kubeconfig=cfg.kubeconfig or None)
    except KubeConfigError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    try:
        return run(client, cfg)
    finally:
        client.close()


def run(client: object, cfg: CleanupConfig) -> int:
    """The cleanup against ``client`` (a kubernetes ApiClient)."""
    from kubernetes.client.rest import ApiException
    from urllib3.exceptions import HTTPError

    from ftagent.kube.cleanup import Cleaner, NodeMarks, marks
    from ftagent.node.conditions import GPU_CONDITION, NIC_CONDITION

    cleaner = Cleaner(client, (GPU_CONDITION, NIC_CONDITION))
    try:
        running = cleaner.running()
        nodes = cleaner.nodes()
    except (ApiException, HTTPError, OSError) as e:
        sys.stderr.write(f"{PROG}: error: listing pods and nodes: {_why(e)}\n")
        return 1
    if running and not cfg.force:
        shown = ", ".join(running[:5]) + (" ..." if len(running) > 5 else "")
        sys.stderr.write(f"{PROG}: error: ftagent still runs ({len(running)} pods: {shown}): "
                         "it would mark nodes again; delete it first (kubectl delete -k "
                         "deploy/), or --force\n")
        return 1
    found = [m for m in (marks(n, cleaner.conditions) for n in nodes) if not m.empty]
    if cfg.dry_run:
        for m in found:
            print(f"would change {m.describe(cfg.uncordon)}")
        print(f"{len(found)} of {len(nodes)} nodes carry ftagent's marks (dry run: nothing "
              "changed)")
        return 0
    failed = 0

    def report(m: NodeMarks) -> None:
        print(m.describe(cfg.uncordon), flush=True)

    for m in found:
        try:
            cleaner.clean(m.node, cfg.uncordon, report)
        except (ApiException, HTTPError, OSError, RuntimeError) as e:
            failed += 1
            sys.stderr.write(f"{PROG}: node {m.node}: not cleaned: {_why(e)}\n")
    print(f"{len(found) - failed} of {len(nodes)} nodes cleaned"
          + (f", {failed} not (see above; run again)" if failed else ""))
    return 1 if failed else 0


def _why(e: BaseException) -> str:
    status = getattr(e, "status", None)
    if status == 403:
        return ("403 Forbidden: your credentials need get/list/update on nodes, patch on "
                "nodes/status and list on pods")
    reason = getattr(e, "reason", None)
    return f"{status} {reason}" if status else f"{type(e).__name__}: {e}"[:300]
