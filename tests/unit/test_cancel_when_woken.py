"""A task woken and cancelled in the same loop step ends (the agent that never exited).

With deadline-driven detector ticks (issue 36) the worker's ticker sleeps on an event (a
detector's due time moved) with a timeout. ``asyncio.wait_for(event.wait(), timeout)``
returns normally, before Python 3.12, when its task is cancelled in the loop step the event
was set (CPython gh-86296): the cancellation is lost, the ticker's ``while True`` waits
again, and ``Worker.run``, which cancels its tasks and awaits them as the worker ends,
waits forever. Seen in CI: the trainer exited 42, the agent wrote ``exited``, the crash
fault, ``stop`` and ``failed``, then sat idle in the loop's select with its ticker
"cancelling" in a fresh wait (the verifier's sampling task ended at the exit and its done
callback woke the ticker; nothing between that and the cancel gave the ticker a turn).
``waits.until_set`` is the wait that stays cancellable (stop 42 moved every such wait in
the package to it: the arbiter link's writer, its barrier and backoff waits, the node
reporter's shard loop).

``Worker.changed`` (the deciders' port) had the same wait on main: a decider's wait there
cancelled as a change arrived went on waiting. Each test here fails on the old code (the
ticker's and ``changed``'s ``wait_for``): checked by running them against it. No sleeps:
bounded waits with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from ftagent.agent.worker import Worker, WorkerSpec
from ftagent.cmd.run import parse
from ftagent.waits import until_set

BOUND = 5.0  # seconds a cancelled task is given to end (it takes one loop step)


async def _ends_cancelled(task: asyncio.Task[object]) -> bool:
    """True when ``task`` ends, cancelled, within BOUND seconds; False when it is still
    running (its cancellation was lost). Cancelled again after, so the loop can close."""
    done, _ = await asyncio.wait({task}, timeout=BOUND)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=BOUND)
        return False
    return task.cancelled()


async def _parked(task: asyncio.Task[object]) -> None:
    """Let ``task`` run up to its first wait (two loop steps: it starts, then its inner
    wait starts)."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()


def test_until_set_is_cancelled_when_set_in_the_same_step() -> None:
    async def main() -> tuple[bool, bool, bool]:
        ev = asyncio.Event()

        async def loop_on_it() -> None:
            while True:  # the ticker's shape: wait, clear, wait again
                await until_set(ev, 30.0)
                ev.clear()

        task = asyncio.create_task(loop_on_it())
        await _parked(task)
        ev.set()
        task.cancel()  # same step: the wait is woken and cancelled at once
        ended = await _ends_cancelled(task)
        timed_out = await until_set(asyncio.Event(), 0.01)
        ev.set()
        return ended, timed_out, await until_set(ev, 30.0)

    ended, timed_out, got = asyncio.run(main())
    assert ended, "a cancellation that came with the wake-up was lost"
    assert timed_out is False and got is True


def _worker() -> Worker:
    return Worker(WorkerSpec(parse(["--max-restarts", "0", "--", "true"], {})))


def test_the_ticker_ends_when_woken_and_cancelled_in_one_step() -> None:
    """The ticker as ``Worker.run`` ends it: a detector's due time moved (``wake_ticker``),
    then, with no loop turn between, the worker ends and cancels it."""
    async def main() -> bool:
        w = _worker()
        task = asyncio.create_task(w._ticker())
        await _parked(task)
        w.wake_ticker()
        task.cancel()
        return await _ends_cancelled(task)

    assert asyncio.run(main()), "the ticker went on after its cancellation: run() hangs"


def test_a_deciders_wait_in_changed_ends_when_cancelled_as_the_change_arrives() -> None:
    """``Worker.changed`` (seat.py's port): a decider waiting there (the barrier, a spare)
    is cancelled in the step the lifecycle's desired state moved. On main it went on
    waiting (the same wait_for)."""
    async def main() -> bool:
        w = _worker()

        async def decider_wait() -> None:
            while True:
                await w.changed(30.0)

        task = asyncio.create_task(decider_wait())
        await _parked(task)
        w.lifecycle.stop(15)  # moves the desired state: sets the worker's change event
        task.cancel()
        return await _ends_cancelled(task)

    assert asyncio.run(main()), "the wait in changed() swallowed its cancellation"



def test_the_node_reporters_shard_loop_ends_when_a_fault_and_its_cancel_come_together() -> None:
    """The node agent's reporter (node/reports.py) sleeps between heartbeats on its shard's
    wake event. A node fault queued (``report`` sets it) in the step the agent stops and
    cancels the loop: on the old ``wait_for`` the loop sent it and slept again, and the node
    agent's shutdown awaited it forever. The gRPC call is replaced (answered at once):
    nothing here connects."""
    from ftagent.model import Fault, FaultKind, Scope, Severity
    from ftagent.node.reports import NodeReporter, Shard
    from ftagent.v1 import ftagent_pb2_grpc as pb_grpc

    async def main() -> tuple[bool, int]:
        reporter = NodeReporter(["127.0.0.1:9"], "n1", "inst", heartbeat=3600.0)
        calls = 0
        called = asyncio.Event()

        async def answered(stub: pb_grpc.ArbiterStub, s: Shard) -> bool:
            nonlocal calls
            calls += 1
            s.pending.clear()
            called.set()
            return True

        reporter._call = answered  # type: ignore[method-assign]
        task = asyncio.create_task(reporter._shard(reporter.shards[0]))
        assert await until_set(called, BOUND)  # the first heartbeat, then the wait
        await _parked(task)
        reporter.report(Fault(kind=FaultKind.GPU, severity=Severity.FATAL, scope=Scope.NODE,
                              message="GPU 0: Xid 79"))
        task.cancel()
        return await _ends_cancelled(task), calls

    ended, calls = asyncio.run(main())
    assert ended, "the shard loop went on after its cancellation: the node agent hangs"
    assert calls == 1



class _Stream:
    """What the arbiter link's writer uses of a gRPC stream: each write lands at once."""

    def __init__(self) -> None:
        self.written: list[object] = []

    async def write(self, msg: object) -> None:
        self.written.append(msg)

    async def done_writing(self) -> None:  # pragma: no cover - the writer is not finishing
        pass


def test_the_arbiter_links_writer_ends_when_a_message_and_its_cancel_come_together() -> None:
    """The agent's link to the arbiter (reporter.py) writes its queue, then sleeps on its
    wake event. A message queued (the trainer's exit, say) in the step the stream is torn
    down and the writer cancelled: on the old ``wait_for`` the writer wrote it and slept
    again, and the stream's teardown awaited it forever."""
    from ftagent.agent.reporter import ArbiterLink
    from ftagent.config import ArbiterClientConfig, IdentityConfig
    from ftagent.v1 import ftagent_pb2 as pb

    async def main() -> tuple[bool, int]:
        lk = ArbiterLink(ArbiterClientConfig(arbiter="127.0.0.1:1"),
                         IdentityConfig(job="j", rank=0))
        stream = _Stream()
        # a progress summary held back until its interval is up: the writer's wait has a
        # timeout (without one, wait_for awaits the event itself and loses nothing)
        core = lk.proto
        core.progress_summary = pb.ProgressSummary(step=1)
        core.progress_new, core.progress_sent_at = True, time.monotonic()
        task = asyncio.create_task(lk._writer(stream))  # type: ignore[arg-type]
        await _parked(task)
        lk._out.append(pb.AgentMessage(ack=pb.Ack(command_id="c1")))
        lk._wake.set()
        task.cancel()
        return await _ends_cancelled(task), len(stream.written)

    ended, written = asyncio.run(main())
    assert ended, "the link's writer went on after its cancellation: its stream never closes"
    assert written == 0


POD_SCRIPT = """
import asyncio, json, os
from ftagent.agent.pod import PodAgent
from ftagent.agent.worker import WorkerSpec
from ftagent.agent.worker_parts import WorkerParts
from ftagent.cmd.run import parse

pod = PodAgent()
cfg = parse(["--max-restarts", "0", "--metrics-port", "-1", "--hang-timeout-min", "1",
             "--", "sh", "-c", "exit 42"], {})
# the crash fault moves a detector's due time (wake_ticker) after the worker's last
# await: the ordering that hung (nothing between the wake and run()'s cancel of the ticker)
pod.add(WorkerSpec(cfg, {"PATH": "/usr/bin:/bin"}),
        parts=lambda w: WorkerParts(fault_hooks=(lambda f: w.wake_ticker(),)))

async def main():
    task = asyncio.create_task(pod.run())
    done, _ = await asyncio.wait({task}, timeout=20)
    out = {"ended": bool(done)}
    if done:
        out["exit"] = task.result().exit_status
    print(json.dumps(out), flush=True)
    os._exit(0)  # a worker that never ended must not hold this process

asyncio.run(main())
"""


def test_an_agent_whose_ticker_is_woken_by_the_crash_fault_exits_with_its_code() -> None:
    """The whole shutdown, real: a pod, a trainer that exits 42, the crash fault waking the
    ticker right before ``Worker.run`` cancels it. On the old ticker the pod never ended.
    (In a process of its own: a pod makes its process a sub-reaper and installs signal
    handlers.)"""
    done = subprocess.run([sys.executable, "-c", POD_SCRIPT], capture_output=True,
                          text=True, timeout=60, check=True)
    got = json.loads(done.stdout.splitlines()[-1])
    assert got == {"ended": True, "exit": 42}, done.stderr[-2000:]


# Waits through asyncio.wait_for on something's ``.wait()`` that remain (the same hazard
# where their task is cancelled in the step the wait ends). Only fewer from here: a new
# one uses ``waits.until_set`` (or ``asyncio.wait``).
KNOWN_WAIT_FOR_WAITS = {
    "ftagent/agent/preflight.py": 1,  # a process's wait after its kill, once, not a loop
}


def test_no_new_wait_for_on_an_event() -> None:
    import ast
    from pathlib import Path

    import ftagent

    root = Path(ftagent.__file__).parent
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        if "v1" in path.relative_to(root).parts:
            continue  # generated protobuf code
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "wait_for" and node.args
                    and isinstance(node.args[0], ast.Call)
                    and isinstance(node.args[0].func, ast.Attribute)
                    and node.args[0].func.attr == "wait"):
                name = path.relative_to(root.parent).as_posix()
                found[name] = found.get(name, 0) + 1
    grown = {f: n for f, n in found.items() if n > KNOWN_WAIT_FOR_WAITS.get(f, 0)}
    assert not grown, f"asyncio.wait_for(<event>.wait(), ...) added (use until_set): {grown}"
    assert "ftagent/agent/worker.py" not in found
