"""A flight-recorder dump, read safely and cut to a bounded summary per process group.

torch writes its flight-recorder dump as a pickle (``_dump_fr_trace``; the NCCL
dump-on-timeout file is the same bytes). ``pickle.load`` on it would run whatever a
crafted file names (``os.system`` through ``__reduce__``), and the file lives where the
trainer -- user code -- can write. :func:`load_dump` admits only the opcodes of plain
data: no class is ever looked up (``find_class`` and ``persistent_load`` refuse), and
the input is bounded before it is parsed. Pure: bytes in, dicts out.

The summary (:func:`summarize`) is what an agent sends and what the arbiter's verdict
(``ftagent/arbiter/fr_verdict.py``) reads, plain JSON, per process group: the last
enqueued, started and completed collective sequence numbers and the entries around them
(op, sizes, dtypes, state, a few frames). Process groups are keyed by their *name*
(``process_group[0]`` of an entry: torch numbers groups in creation order, the same on
every rank), not by ``pg_id``, a per-rank index that differs between the ranks of two
sibling groups. Gloo records ``state`` ``scheduled`` and no start (``-1``) for every
entry; completion is in ``pg_status``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

MAX_DUMP_BYTES = 32 << 20  # a 20k-entry NCCL dump with stacks is a few MiB
MAX_GROUPS = 64
MAX_ENTRIES = 4  # per group: the last enqueued and the ones just before it
MAX_TENSORS = 8
MAX_DIMS = 8
MAX_FRAMES = 6
MAX_TEXT = 160


class DumpError(ValueError):
    """The dump is not plain data, too large, or not a flight-recorder dump."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(f"refused: the dump names a callable ({module[:60]}.{name[:60]}); "
                        "a flight-recorder dump is plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise DumpError("refused: the dump uses a persistent id")


def load_dump(data: bytes) -> dict[str, Any]:
    """The dump as plain data (dict/list/tuple/str/bytes/int/float/bool/None); DumpError
    for anything else. Never ``pickle.load``."""
    if len(data) > MAX_DUMP_BYTES:
        raise DumpError(f"dump of {len(data)} bytes is over the {MAX_DUMP_BYTES} limit")
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except DumpError:
        raise
    except Exception as e:  # truncated, not a pickle, recursion: all one clear error
        raise DumpError(f"not a readable pickle: {type(e).__name__}: {e}"[:200]) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("entries", []), list):
        raise DumpError("not a flight-recorder dump (no dict with entries)")
    return obj


def _text(v: Any) -> str:
    return v[:MAX_TEXT] if isinstance(v, str) else ""


def _dict(v: Any) -> dict[Any, Any]:
    return v if isinstance(v, dict) else {}


def _int(v: Any, default: int = -1) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _sizes(v: Any) -> list[list[int]]:
    if not isinstance(v, list):
        return []
    out = []
    for t in v[:MAX_TENSORS]:
        if isinstance(t, list):
            out.append([_int(d, 0) for d in t[:MAX_DIMS]])
    return out


def _strs(v: Any, n: int = MAX_TENSORS) -> list[str]:
    return [_text(x) for x in v[:n]] if isinstance(v, list) else []


def op_name(profiling_name: str) -> str:
    """``gloo:all_reduce`` / ``nccl:all_reduce`` -> ``all_reduce``."""
    return profiling_name.split(":", 1)[-1]


def _frames(v: Any) -> list[str]:
    """Innermost first, torch's own frames left out: the first is the program's call."""
    out = []
    if isinstance(v, list):
        for f in v[:256]:
            if isinstance(f, dict) and "/torch/" not in _text(f.get("filename")):
                out.append(f"{_text(f.get('filename'))}:{_int(f.get('line'), 0)} "
                           f"{_text(f.get('name'))}")
                if len(out) == MAX_FRAMES:
                    break
    return out


def _entry(e: dict[str, Any]) -> dict[str, Any]:
    return {"seq": _int(e.get("collective_seq_id")),
            "op": op_name(_text(e.get("profiling_name"))),
            "in_sizes": _sizes(e.get("input_sizes")),
            "out_sizes": _sizes(e.get("output_sizes")),
            "dtypes": _strs(e.get("input_dtypes")),
            "state": _text(e.get("state")),
            "frames": _frames(e.get("frames"))}


def _group_key(e: dict[str, Any]) -> tuple[str, str]:
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        return _text(pg[0]), _text(pg[1])
    return f"#{_int(e.get('pg_id'))}", ""


def summarize(dump: dict[str, Any], rank: int) -> dict[str, Any]:
    """One rank's dump -> ``{"rank", "version", "groups": [...]}``, bounded (module doc)."""
    names: dict[int, tuple[str, str]] = {}
    per: dict[str, list[dict[str, Any]]] = {}
    for e in dump.get("entries") or []:
        if not isinstance(e, dict) or e.get("is_p2p") is True:
            continue
        name, desc = _group_key(e)
        pid = _int(e.get("pg_id"))
        names.setdefault(pid, (name, desc))
        bucket = per.setdefault(name, [])
        bucket.append(e)
        if len(bucket) > MAX_ENTRIES:  # the ring is oldest-first: keep the newest
            del bucket[0]
    config = _dict(dump.get("pg_config"))
    groups = []
    status = _dict(dump.get("pg_status"))
    for key, st in list(status.items())[:MAX_GROUPS]:
        if not isinstance(st, dict):
            continue
        pid = _int(int(key) if isinstance(key, str) and key.isdigit() else key)
        name, desc = names.get(pid, (f"#{pid}", ""))
        cfg = _dict(config.get(name))
        groups.append({
            "name": name, "desc": desc, "ranks": _ranks(cfg.get("ranks")),
            "enqueued": _int(st.get("last_enqueued_collective")),
            "started": _int(st.get("last_started_collective")),
            "completed": _int(st.get("last_completed_collective")),
            "entries": [_entry(e) for e in per.get(name, [])]})
    return {"rank": rank, "version": _text(dump.get("version")), "groups": groups}


def _ranks(v: Any) -> list[int]:
    """pg_config's ``ranks``: a string like ``"[0, 1]"`` (NCCL); gloo leaves ``"[]"``."""
    if not isinstance(v, str) or len(v) > 4096:
        return []
    out: list[int] = []
    for part in v.strip("[] ").split(","):
        part = part.strip()
        if part.isdigit() and len(out) < 4096:
            out.append(int(part))
    return out
