"""The bundle's entry point: ``ftagent`` as the console script, ``ftagent -I -S -c CODE
ARGS...`` as ``python -I -S -c`` (the agent runs its exec shim and watchdog with
``sys.executable -c``; in the bundle ``sys.executable`` is this program), and
``ftagent --ftagent-entry-probe``: the entry shim's check that ``ftagent run`` can start
here (ftagent/cmd/probe.py; no flag of any command, so no environment can reach it)."""

import sys

PYTHON_FLAGS = ("-I", "-S", "-E", "-s", "-u", "-B")
PROBE = "--ftagent-entry-probe"


def _as_python_c(argv: list[str]) -> bool:
    args = argv[1:]
    while args and args[0] in PYTHON_FLAGS:
        args = args[1:]
    if len(args) < 2 or args[0] != "-c":
        return False
    code = args[1]
    sys.argv = ["-c", *args[2:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    return True


if __name__ == "__main__":
    if sys.argv[1:] == [PROBE]:
        from ftagent.cmd.probe import main as probe

        sys.exit(probe())
    if not _as_python_c(sys.argv):
        from ftagent.cli import main

        sys.exit(main())
