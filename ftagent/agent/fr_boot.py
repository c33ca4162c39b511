"""The flight-recorder dump trigger, run inside the trainer's Python as ``sitecustomize``.

The agent copies this file (stdlib only: the trainer's Python may not import ftagent) to
``FR_DIR/site/sitecustomize.py`` and puts that directory first on the trainer's
``PYTHONPATH`` (``flight_recorder.py``), so every Python the trainer starts (cold, warm
standby, a torchrun child) runs it at start-up with no change to the training script.
It then chains to the ``sitecustomize`` the trainer would have imported without it.

What it does: one daemon thread per process blocks in ``open()`` on a FIFO
``FR_DIR/trigger/<pid>.fifo``. Any byte the agent writes there makes the thread call
torch's own ``torch._C._distributed_c10d._dump_fr_trace`` (the pickle NCCL writes on a
timeout, here for gloo too) and write it atomically to ``<TORCH_FR_DUMP_TEMP_FILE><rank>``
-- the file torch's dump-on-timeout writes, so one reader serves both. Nothing happens in
a process that has not imported torch or has no process group (a torchrun parent, a
spawned data-loader worker): it writes no file rather than an empty one for its rank.

Why a thread and not a signal handler: CPython runs signal handlers on the main thread
only, between bytecodes, and a hung trainer's main thread is usually blocked in a C call
(a collective's wait) that never returns. The thread needs only the GIL: a main thread
waiting in a gloo/NCCL collective has released it, one spinning in Python yields it every
5 ms. A main thread stuck *holding* the GIL inside a C extension starves this thread
too: no dump comes, and the agent's reader treats the rank as unresponsive (its stacks,
taken from outside by py-spy, still tell where it is).
"""

from __future__ import annotations

import os
import sys
import threading

MAX_TRIGGER = 64  # bytes read from the FIFO per wake-up; their content is not used


def _dump_prefix() -> str:
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or \
        os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or ""


def dump_now() -> str | None:
    """Write this rank's flight-recorder dump; the path written, or None (nothing to dump)."""
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    prefix = _dump_prefix()
    if dist is None or c10d is None or not prefix:
        return None
    fn = getattr(c10d, "_dump_fr_trace", None)
    if fn is None or not dist.is_available() or not dist.is_initialized():
        return None
    # includeStackTraces=False: symbolizing the recorded frames imports torch._dynamo
    # (~800 modules, 3.3 s measured here) holding the GIL -- training would stall and the
    # dump come late. 0.1 ms without; the agent's py-spy stacks say where each rank is.
    data = fn(True, False, False)
    path = f"{prefix}{dist.get_rank()}"
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a reader never sees half a dump
    return path


def _serve(fifo: str) -> None:
    while True:
        try:
            fd = os.open(fifo, os.O_RDONLY)  # blocks (GIL released) until a writer opens
        except OSError:
            return  # the FIFO is gone: the agent cleaned up; stop quietly
        try:
            wake = os.read(fd, MAX_TRIGGER)
        finally:
            os.close(fd)
        if wake:
            path = None
            try:
                path = dump_now()
            except Exception as e:  # never into the trainer: say it once per trigger
                print(f"ftagent: flight-recorder dump failed: {e}", file=sys.stderr)
            _answer(fifo, path or "")


def _answer(fifo: str, path: str) -> None:
    """``<fifo>.done``: this process answered (with its dump's path, or none), so the
    agent stops waiting as soon as every process it reached has answered."""
    tmp = f"{fifo}.done.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(path)
        os.replace(tmp, f"{fifo}.done")
    except OSError:
        pass


def _install() -> None:
    base = os.environ.get("FTAGENT_FR_DIR", "")
    if not base:
        return
    tdir = os.path.join(base, "trigger")
    fifo = os.path.join(tdir, f"{os.getpid()}.fifo")
    try:
        if os.path.lexists(fifo):
            os.unlink(fifo)  # a previous process with this pid (an exec keeps the pid)
        os.mkfifo(fifo, 0o600)
    except OSError:
        return  # no trigger directory (not under the agent): nothing to install
    threading.Thread(target=_serve, args=(fifo,), name="ftagent-fr-trigger",
                     daemon=True).start()


def _torch_at_least(major: int, minor: int) -> bool:
    """The installed torch's version, read from torch/version.py without importing torch."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return False
        path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        with open(path, encoding="utf-8") as f:
            m = re.search(r"__version__\s*=\s*['\"](\d+)\.(\d+)", f.read(65536))
    except (OSError, ImportError, ValueError):
        return False
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (major, minor)


def _drop_legacy_names() -> None:
    """The agent sets torch's pre-2.8 names too (for old torch); 2.8+ reads the new ones
    and warns about every old one set, into the trainer's stderr: drop ours there."""
    names = [n for n in os.environ.pop("FTAGENT_FR_LEGACY", "").split(",") if n]
    if names and _torch_at_least(2, 8):
        for n in names:
            os.environ.pop(n, None)


def _chain() -> None:
    """Import the ``sitecustomize`` that this one shadows, as site.py would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = sys.path[:]
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import sitecustomize  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


def _leave_path() -> None:
    """The program sees the ``sys.path`` a direct run has (``PYTHONPATH`` keeps this
    directory, so the trainer's own Python children load the trigger too)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


if __name__ == "sitecustomize":
    _drop_legacy_names()
    _install()
    _chain()
    _leave_path()
