"""The ``ftagent`` command: a thin dispatcher to one module per subcommand.

Each subcommand module has ``main(argv: list[str]) -> int``; it is imported only when
used, so ``ftagent run`` does not pay for the arbiter's imports and vice versa.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from ftagent import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("ftagent.cmd.run", "supervise a training command: ftagent run [flags] -- CMD"),
    "arbiter": ("ftagent.cmd.arbiter", "run the central arbiter that decides for whole jobs"),
    "node": ("ftagent.cmd.node", "host agent (DaemonSet): node GPU/NIC faults and conditions"),
    "status": ("ftagent.cmd.status", "show jobs, ranks and timelines from an arbiter"),
    "token": ("ftagent.cmd.token", "print the token that speaks for one job only"),
    "report": ("ftagent.report", "one HTML page about a job: steps, faults, downtime, goodput"),
    "webhook": ("ftagent.cmd.webhook", "admission webhook that injects ftagent into pods"),
    "demo": ("ftagent.demo", "local demo: arbiter + agents + a real training job with faults"),
    "cleanup": ("ftagent.cmd.cleanup", "after an uninstall: take ftagent's taints, labels, "
                "annotations and conditions off the nodes"),
}

USAGE = "usage: ftagent {" + ",".join(COMMANDS) + "} [flags] ... (ftagent COMMAND --help)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        print()
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<9} {doc}")
        return 0 if args else 2
    if args[0] == "--version":
        print(f"ftagent {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        sys.stderr.write(f"ftagent: error: unknown command {name!r}; one of: "
                         f"{', '.join(COMMANDS)}; to supervise a training command: "
                         "ftagent run [flags] -- CMD (see ftagent --help)\n")
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(args[1:]))
