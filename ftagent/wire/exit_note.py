"""An exit the arbiter did not hear, left where the next arbiter finds it.

An agent whose trainer ended while its arbiter was away (restarting, failing over) says
the exit again on its next stream and waits ``--arbiter-fail-open-after`` for an arbiter
to confirm it read it. Past that wait it exits all the same; an agent that shares the
arbiter's ``--state-dir`` (one machine, a shared volume) first leaves the exit there, as
one small file in ``DIR/exits/`` (written aside and renamed in: never read half
written)::

    {"t": "x", "namespace": "", "job": "j", "rank": 0, "generation": 3, "status": 0,
     "ts": 1700000000.0}

The next arbiter, or the running one (its tick looks every few seconds), reads and
removes them (``take``, from ``arbiter/history_file.py``) and applies each as the rank's
exit (``Registry.exits_seen``), so ``ftagent status`` says succeeded or failed, not
"gone". In Kubernetes the pods' terminal status says the same (``kube/cluster.py``).

Agent and arbiter both use this module (the format is their contract). To the arbiter it
is peer input: every field is checked here (``parse``), a file that is not a note is
removed unread past ``MAX_NOTE`` bytes, at most ``MAX_TAKEN`` are read per look, and a
note changes only the rank it names of a job that has not finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ftagent.wire.limits import MAX_CLAIMED_GENERATION, MAX_NAME, MAX_WORLD_SIZE

DIR = "exits"  # under the arbiter's --state-dir
TYPE = "x"
MAX_NOTE = 2048  # bytes of one exit note (names are at most MAX_NAME characters)
MAX_TAKEN = 1000  # notes read per look (the rest wait for the next)


@dataclass(frozen=True, slots=True)
class ExitNote:
    namespace: str
    job: str
    rank: int
    generation: int
    status: int  # the trainer's exit status (128+signal when killed)
    ts: float

    def to_json(self) -> dict[str, Any]:
        return {"t": TYPE, "namespace": self.namespace, "job": self.job, "rank": self.rank,
                "generation": self.generation, "status": self.status, "ts": self.ts}


def _int(d: dict[str, Any], name: str, hi: int) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise ValueError(f"exit note: {name} is not an integer in 0..{hi}")
    return v


def parse(d: Any) -> ExitNote:
    """An exit note from its JSON object; ValueError for one that is not (bounded names,
    a rank below the largest world size, a generation an agent may claim, a status an
    exit can have)."""
    if not isinstance(d, dict) or d.get("t") != TYPE:
        raise ValueError("not an exit note")
    namespace, job = d.get("namespace", ""), d.get("job")
    if not isinstance(namespace, str) or len(namespace) > MAX_NAME or \
            not isinstance(job, str) or not 0 < len(job) <= MAX_NAME:
        raise ValueError("exit note: the job's name or namespace is not one")
    ts = d.get("ts", 0.0)
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not 0 <= ts < 1e12:
        raise ValueError("exit note: ts is not a time")
    return ExitNote(namespace, job, _int(d, "rank", MAX_WORLD_SIZE - 1),
                    _int(d, "generation", MAX_CLAIMED_GENERATION), _int(d, "status", 255),
                    float(ts))


def leave(directory: str, namespace: str, job: str, rank: int, generation: int,
          status: int, at: float | None = None) -> bool:
    """Leave the exit in ``directory`` (the arbiter's --state-dir); False, never an
    exception, when it cannot: the agent exits with its trainer's code all the same."""
    note = ExitNote(namespace, job, rank, generation, status,
                    time.time() if at is None else at)
    try:
        parse(note.to_json())  # what the arbiter would refuse is not written
        where = os.path.join(directory, DIR)
        os.makedirs(where, mode=0o700, exist_ok=True)
        name = uuid.uuid4().hex
        tmp = os.path.join(where, f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(note.to_json(), f, separators=(",", ":"))
        os.replace(tmp, os.path.join(where, f"{name}.json"))
        return True
    except (OSError, ValueError):
        return False


def take(directory: str, limit: int = MAX_TAKEN) -> list[ExitNote]:
    """The exit notes left in ``directory`` (the arbiter's --state-dir), oldest first, each
    removed once read (one that is not a note too); [] when there are none or the
    directory cannot be read. Never raises."""
    where = os.path.join(directory, DIR)
    try:
        names = sorted((e.stat(follow_symlinks=False).st_mtime, e.name)
                       for e in os.scandir(where)
                       if e.name.endswith(".json") and not e.name.startswith("."))
    except OSError:
        return []
    out = []
    for _, name in names[:limit]:
        path = os.path.join(where, name)
        try:  # a link or a FIFO put in its place is neither followed nor waited on
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                raw = os.read(fd, MAX_NOTE + 1) if stat.S_ISREG(os.fstat(fd).st_mode) \
                    else b""
            finally:
                os.close(fd)
            if 0 < len(raw) <= MAX_NOTE:
                out.append(parse(json.loads(raw)))
        except (OSError, ValueError):
            pass  # not a note (or gone): removed all the same
        with contextlib.suppress(OSError):
            os.unlink(path)
    return out
