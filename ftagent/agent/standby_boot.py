"""The standby interpreter: imports the trainer's modules early, waits, then *becomes* it.

Runs under the TRAINER's Python (the interpreter and flags of its command), never the
agent's: the agent may be a PyInstaller bundle whose code that Python cannot import. So
this file is stdlib only and imports nothing of ftagent; the agent copies it to a private
directory and runs it by path (``standby.py``). It is started through the same exec shim
as a cold trainer (PR_SET_PDEATHSIG, its own session, the trainer's cgroup), with
stdout/stderr already the pipes the agent will read when it becomes the trainer.

argv: ``KIND TARGET SPEC_JSON`` (KIND ``script`` or ``module``). SPEC: ``go`` and
``status`` (fds), ``agent`` (pid), ``imports`` (explicit modules; failure -> cold),
``learn`` (learn imports from the script), ``idle`` (import under SCHED_IDLE).

1. Put ``sys.path[0]`` where a cold start would have it (the script's real directory, or
   the working directory for ``-m``), before any import.
2. Import the warm modules (``--warm-imports``, or learned from the script with ``ast``:
   every absolute import statement not inside a ``try`` or ``if TYPE_CHECKING``, in the
   script and in the local modules it imports, skipping local modules themselves, which
   run user code), under SCHED_IDLE when the priority can be restored later (every
   thread of the process is restored after the imports, or by the agent at the go if it
   comes first). Learned
   imports also bring the modules a framework imports lazily on first use
   (:data:`LAZY_COMPANIONS`: ``torch._dynamo`` for torch, which the first optimizer built
   imports: ~800 modules, sympy among them, 1.1-3.4 s of a restart measured by
   bench/restart.py). Only imports: nothing here initialises CUDA.
3. Write ``ready`` on the status pipe, block on the go pipe. EOF without a message: the
   agent dropped this standby; exit.
4. The go carries the final argv, working directory and the environment's difference to
   the one this process started with. Anything that would make this process differ from
   a fresh start -- an import failed, the command or the working directory changed, the
   script, the interpreter, a ``sys.path`` directory or a loaded module's file changed,
   the priority cannot be restored -- and it ``exec``s the command instead: a cold start
   with the same pid, pipes, session and death signal. Otherwise it restores the signal
   dispositions it started with, sets PDEATHSIG again, re-checks its parent, closes its
   control pipes, sets ``sys.argv``/``sys.orig_argv``, and runs the script as
   ``__main__`` (a fresh module, ``__file__`` absolute as CPython sets it) or the module
   through ``runpy._run_module_as_main`` exactly as ``python -m`` does. An uncaught
   exception is printed without this file's frames and exits 1 (KeyboardInterrupt: by
   SIGINT after finalisation, as CPython does).
"""

from __future__ import annotations

import os
import sys

# 1. before any other import: the path a cold start would have (unless -I/-P left it out)
_KIND, _TARGET = sys.argv[1], sys.argv[2]
_HERE = os.path.dirname(os.path.realpath(__file__))
_PATH0 = os.path.dirname(os.path.realpath(_TARGET)) if _KIND == "script" else os.getcwd()
if sys.path and sys.path[0] == _HERE:
    sys.path[0] = _PATH0

import ast  # noqa: E402
import atexit  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

Inputs = dict  # path -> (mtime_ns, size, inode) or None: what must not change before the go

PR_SET_PDEATHSIG = 1
MAX_LEARN_FILES = 64  # local files followed for imports
MAX_SOURCE = 4 << 20  # bytes of one file parsed
CAP_SYS_NICE = 23
# Imported after a learned import of the key: what that package imports lazily, at a
# first use every training script makes, so a warm start would still pay for it. Each is
# import-only and reads no per-attempt variable at import (RANK, MASTER_ADDR, ...).
# torch._dynamo: the first optimizer built imports it (torch.optim.optimizer, and
# torch._disable_dynamo on the methods torch.optim decorates).
LAZY_COMPANIONS = {"torch": ("torch._dynamo",)}

_spec = json.loads(sys.argv[3])
_GO, _STATUS, _AGENT = int(_spec["go"]), int(_spec["status"]), int(_spec["agent"])
for _fd in (_GO, _STATUS):
    os.set_inheritable(_fd, False)  # a cold exec or the trainer's children never see them
_START_ENV = dict(os.environ)
_START_CWD = os.getcwd()
_DISPOSITIONS: dict[int, Any] = {}
for _sig in signal.valid_signals():
    with contextlib.suppress(OSError, ValueError):
        _DISPOSITIONS[_sig] = signal.getsignal(_sig)
_SIGINT_EXIT: list[bool] = []  # set when the script died of an uncaught KeyboardInterrupt


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(_STATUS, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _is_local(spec: Any) -> bool:
    """Found through ``sys.path[0]`` (beside the script, or in the working directory for
    ``-m``): the user's own code, whose import runs it; such modules are followed, never
    imported early."""
    locs = list(spec.submodule_search_locations or ())
    where = locs[0] if locs else spec.origin
    if not where or not isinstance(where, str):
        return False
    return os.path.realpath(os.path.dirname(where)) == os.path.realpath(_PATH0)


def _learn(path: str) -> list[str]:
    """Absolute imports of ``path`` and of the local modules it imports (followed, not
    imported): those not inside ``try`` (optional dependencies) or ``if TYPE_CHECKING``."""
    found: list[str] = []
    files = [path]
    seen: set[str] = set()
    while files and len(seen) < MAX_LEARN_FILES:
        f = files.pop()
        if f in seen:
            continue
        seen.add(f)
        try:
            with open(f, "rb") as fh:
                tree = ast.parse(fh.read(MAX_SOURCE))
        except (OSError, SyntaxError, ValueError, RecursionError):
            continue
        for name in _imports_of(tree):
            top = name.split(".")[0]
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError, AttributeError):
                continue
            if spec is None:
                continue  # not installed: the script fails on it, or never needs it
            if _is_local(spec):
                files += _local_files(spec, name)
            elif name not in found:
                found.append(name)
    return found


def _local_files(spec: Any, name: str) -> list[str]:
    """The file of local module ``name`` (and its package's ``__init__``), found on disk."""
    out = [spec.origin] if spec.origin and spec.origin.endswith(".py") else []
    base = list(spec.submodule_search_locations or ())
    parts = name.split(".")[1:]
    for d in base:
        p = os.path.join(d, *parts)
        for cand in (p + ".py", os.path.join(p, "__init__.py")):
            if os.path.isfile(cand):
                out.append(cand)
    return out


def _imports_of(tree: ast.AST) -> list[str]:
    out: list[str] = []

    def visit(node: ast.AST, optional: bool) -> None:
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar" or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)):
            optional = True
        if not optional:
            if isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module != "__future__":
                out.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(tree, False)
    return out


def _can_restore_priority() -> bool:
    """Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE that allows our nice value."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        if soft == resource.RLIM_INFINITY or 20 - os.getpriority(os.PRIO_PROCESS, 0) <= soft:
            return True
    except (ImportError, OSError, AttributeError, ValueError):
        pass
    try:
        with open("/proc/self/status") as f:
            caps = next(line.split()[1] for line in f if line.startswith("CapEff:"))
        return bool(int(caps, 16) >> CAP_SYS_NICE & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def _restore_threads(policy: int, param: Any) -> bool:
    """Every thread of this process back from SCHED_IDLE, this one first. A thread that an
    import started (torch's starts one) inherited SCHED_IDLE, and ``sched_setscheduler(0)``
    moves only the calling thread: it would stay idle for the whole training. The agent
    does the same from outside at the go (``standby.leave_idle``), for a go that comes
    while imports still run."""
    me = os.getpid()
    try:
        tids = sorted((int(t) for t in os.listdir("/proc/self/task")), key=lambda t: t != me)
    except (OSError, ValueError):
        tids = [me]
    ok = True
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, policy, param)
        except ProcessLookupError:
            continue  # the thread ended
        except OSError:
            ok = False
    return ok


def _go_waiting() -> bool:
    """The go (or the agent's EOF) is already in the pipe."""
    import select

    try:
        return bool(select.select([_GO], [], [], 0)[0])
    except (OSError, ValueError):
        return False


def _prepare() -> tuple[list[str], dict[str, float], list[str], Inputs]:
    """Import the warm modules; returns (failures, fingerprint of the inputs)."""
    script = os.path.realpath(_TARGET) if _KIND == "script" else None
    inputs = {sys.executable: _stat(sys.executable)}
    if script:
        inputs[script] = _stat(script)
    for d in sys.path:
        if d and os.path.isdir(d):
            inputs[d] = _stat(d)
    names = list(_spec.get("imports") or ())
    explicit = set(names)
    if _spec.get("learn") and not names:
        origin = script
        if _KIND == "module":
            try:
                s = importlib.util.find_spec(_TARGET.split(".")[0])
                origin = s.origin if s is not None and "." not in _TARGET else None
            except (ImportError, ValueError):
                origin = None
        names = _learn(origin) if origin else []
        for top, extra in LAZY_COMPANIONS.items():
            if any(n == top or n.startswith(top + ".") for n in names):
                names += [m for m in extra if m not in names]
    idle = bool(_spec.get("idle")) and hasattr(os, "SCHED_IDLE") and _can_restore_priority()
    old = None
    if idle:
        try:
            old = (os.sched_getscheduler(0), os.sched_getparam(0))
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            old = None
        if old is not None and _go_waiting():  # the go came first: no idle imports
            _restore_threads(*old)
    failures, took = [], {}
    for name in names:
        t0 = time.monotonic()
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: B036 - any failure means: start cold
            if name in explicit or not isinstance(e, ModuleNotFoundError):
                failures.append(f"{name}: {type(e).__name__}: {e}"[:300])
        took[name] = round(time.monotonic() - t0, 3)
    if old is not None and not _restore_threads(*old):
        failures.append("cannot leave SCHED_IDLE")
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if isinstance(f, str) and f not in inputs:
            inputs[f] = _stat(f)
    return names, took, failures, inputs


def _read_go() -> bytes:
    chunks = []
    while True:
        try:
            b = os.read(_GO, 1 << 16)
        except InterruptedError:
            continue
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks)


def _changed(inputs: Inputs) -> str | None:
    for path, st in inputs.items():
        if _stat(path) != st:
            return path
    return None


def _final_env(go: dict[str, Any]) -> dict[str, str]:
    env = dict(_START_ENV)
    env.update(go.get("set") or {})
    for k in go.get("unset") or ():
        env.pop(k, None)
    return env


def _cold(go: dict[str, Any], reason: str) -> None:
    """exec the command: a cold start in this very process (pid, pipes, session kept)."""
    _say("cold " + reason)
    argv = go["argv"]
    for sig, h in _DISPOSITIONS.items():  # SIG_IGN survives exec: leave what a shim leaves
        if h in (signal.SIG_IGN, signal.SIG_DFL):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, h)
    try:
        os.chdir(go["cwd"])
        os.execvpe(argv[0], argv, _final_env(go))
    except OSError as e:
        sys.stderr.write(f"ftagent: cannot start {argv[0]}: {e.strerror}\n")
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


def _become(go: dict[str, Any]) -> None:
    env = _final_env(go)
    for k in list(os.environ):  # the difference only: what imports set stays, as cold
        if k in _START_ENV and k not in env:
            del os.environ[k]
    for k, v in env.items():
        if _START_ENV.get(k) != v:
            os.environ[k] = v
    for sig, h in _DISPOSITIONS.items():
        if h is not None and signal.getsignal(sig) != h:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, h)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != _AGENT:
        os._exit(137)
    _say("warm")
    for fd in (_GO, _STATUS):
        with contextlib.suppress(OSError):
            os.close(fd)
    argv = list(go["argv"])
    skip = int(go["interp"])  # argv entries before the script or -m
    own = list(getattr(sys, "orig_argv", ()))[:-4]  # the interpreter and its flags
    if _KIND == "script":
        sys.argv = [go["script_argv0"]] + argv[skip + 1:]
        if hasattr(sys, "orig_argv"):
            sys.orig_argv = own + sys.argv
        _run_script(os.path.abspath(go["script_argv0"]))
    else:
        sys.argv = ["-m"] + argv[skip + 2:]
        if hasattr(sys, "orig_argv"):
            sys.orig_argv = own + argv[skip:]
        import builtins
        import runpy

        main = type(sys)("__main__")
        vars(main)["__builtins__"] = builtins
        sys.modules["__main__"] = main
        runpy._run_module_as_main(_TARGET, alter_argv=True)  # type: ignore[attr-defined]


def _run_script(path: str) -> None:
    import builtins
    from importlib.machinery import SourceFileLoader

    main = type(sys)("__main__")
    vars(main).update(__file__=path, __cached__=None, __builtins__=builtins, __spec__=None,
                      __package__=None, __loader__=SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _at_exit() -> None:
    """Registered first, so it runs last: CPython exits by SIGINT after an uncaught
    KeyboardInterrupt, once finalisation is done."""
    if _SIGINT_EXIT:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def _main() -> None:
    names, took, failures, inputs = _prepare()
    _say("ready " + json.dumps({"imports": names, "seconds": took, "failures": failures,
                                "modules": len(sys.modules)}))
    raw = _read_go()
    if not raw:
        os._exit(0)
    go = json.loads(raw)
    reason = None
    if failures:
        reason = "warm import failed: " + failures[0]
    elif go.get("cwd") != _START_CWD:
        reason = "working directory changed"
    else:
        path = _changed(inputs)
        if path is not None:
            reason = "changed since the standby started: " + path
    if reason is not None:
        _cold(go, reason)
    atexit.register(_at_exit)
    try:
        _become(go)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: B036 - printed as CPython would, then exit 1
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        e.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
        if hasattr(sys, "last_exc"):
            sys.last_exc = e
        sys.excepthook(type(e), e, tb)
        if isinstance(e, KeyboardInterrupt):
            _SIGINT_EXIT.append(True)
        del e, tb
        sys.exit(1)


_main()
