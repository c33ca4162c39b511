"""One fault's walk, counted: files and file-to-file hops.

    PYTHONPATH=TREE .venv/bin/python bench/fault_walk.py

The arbiter's part (``arbiter_walk``, ``report_arbiter``): drives a ``Registry`` in this
process as the server would (two ranks: Hello, arrivals at generation 0, rank 1's CRASH,
both arrivals at generation 1) and traces every call into the package
(``sys.setprofile``) in two phases: the fault until the RESTART commands are queued, and
the arrivals until the RELEASE is queued. Prints per phase the ftagent files entered, the
distinct file-to-file edges (caller's file -> callee's file) and every call that crosses
a file, then both phases' total against the figure before. Run with PYTHONPATH at another
tree to count that revision.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from types import FrameType
from typing import Any

import ftagent
from ftagent.arbiter import policy
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb

PKG = os.path.dirname(os.path.abspath(ftagent.__file__))


def short(path: str) -> str | None:
    path = os.path.abspath(path)
    if not path.startswith(PKG) or "/v1/" in path:
        return None  # outside the package, or generated protobuf code
    return os.path.relpath(path, os.path.dirname(PKG))


class Walk:
    def __init__(self) -> None:
        self.files: set[str] = set()
        self.edges: Counter[tuple[str, str]] = Counter()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = short(frame.f_code.co_filename)
        if callee is None:
            return
        self.files.add(callee)
        caller = frame.f_back
        while caller is not None and short(caller.f_code.co_filename) is None:
            caller = caller.f_back  # through the standard library (dataclasses, protobuf)
        src = short(caller.f_code.co_filename) if caller is not None else None
        if src is not None and src != callee:
            self.edges[(src, callee)] += 1

    def report(self, name: str) -> None:
        print(f"{name}: {len(self.files)} files, {len(self.edges)} distinct file-to-file "
              f"hops, {sum(self.edges.values())} cross-file calls")
        for (a, b), n in sorted(self.edges.items()):
            print(f"    {a} -> {b}" + (f"  x{n}" if n > 1 else ""))


def traced(name: str, fn: Any) -> Walk:
    w = Walk()
    sys.setprofile(w)
    try:
        fn()
    finally:
        sys.setprofile(None)
    w.report(name)
    return w


# The arbiter part as counted before (issue 36 was filed at 67 calls in 17 files; this
# stop started at 71 in 18, the snapshot step added since) and as issue 36 wants it.
ARBITER_BEFORE = (71, 18)
ARBITER_GOAL = 30


def arbiter_walk() -> tuple[Walk, Walk]:
    """The arbiter's side of one crash, traced: a ``Registry`` in this process as the
    server drives it (two ranks: Hello, arrivals at generation 0, rank 1's CRASH, both
    arrivals at generation 1). Returns the two phases' walks: the fault until the RESTART
    commands are queued, the arrivals until the RELEASE is queued."""
    now = [1_000.0]
    reg = Registry(policy.PolicyConfig(), Timeline(), None, "walk", clock=lambda: now[0])
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="walk", rank=r, world_size=2, pod=f"p{r}", node="n",
                              agent_instance=f"i{r}", state="waiting"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)),
                   time.monotonic())
    fault = pb.AgentMessage(fault=pb.Fault(id="f1", kind=pb.FAULT_KIND_CRASH,
                                           message="exit 1", generation=0, exit_status=1,
                                           detected_at=now[0]))
    a = traced("fault -> RESTART queued", lambda: reg.handle(conns[1], fault, time.monotonic()))

    def arrive() -> None:
        for c in conns:
            reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=1)),
                       time.monotonic())

    b = traced("arrivals -> RELEASE queued", arrive)
    job = reg.jobs[("", "walk")]
    assert job.generation == 1 and job.barrier is not None and job.barrier.released, job
    return a, b


def report_arbiter(a: Walk, b: Walk) -> tuple[int, int]:
    """Both phases together, against the figure before: (cross-file calls, files)."""
    files = a.files | b.files
    calls = sum(a.edges.values()) + sum(b.edges.values())
    print(f"arbiter part: {calls} cross-file calls, {len(files)} files, "
          f"{len(set(a.edges) | set(b.edges))} distinct hops (before: {ARBITER_BEFORE[0]} "
          f"calls, {ARBITER_BEFORE[1]} files; issue 36's goal: <= {ARBITER_GOAL} calls)")
    print("files: " + ", ".join(sorted(f.removeprefix("ftagent/") for f in files)))
    return calls, len(files)


def main() -> int:
    print(f"package: {PKG}")
    report_arbiter(*arbiter_walk())
    return 0


if __name__ == "__main__":
    sys.exit(main())
