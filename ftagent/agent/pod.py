"""The pod agent: one agent process, its N workers and the parts they share.

``ftagent run -- CMD`` is one worker; ``ftagent run --nproc-per-node N`` is N (the
launcher: torchrun's local group). A :class:`PodAgent` holds, by composition:

* its workers (worker.py: one trainer process each, built from a ``WorkerSpec``,
  worker_spec.py), each its own rank to the arbiter;
* one decider for them all (decider.py): the local policy for the workers together
  (``LocalDecider``: what it decides stops and restarts them all), or the arbiter's
  (arbiter_decider.py ``ArbiterDecider``: one link session per rank inside it, failing
  open to that same local policy). The workers reach it only through its port;
* the process-wide parts: one SIGCHLD reaper and the sub-reaper, the stop signals
  (forwarded to every worker), and the cleanup that no trainer outlives the agent.

The sinks (one /metrics port) and the node's GPU and NIC sources (on local rank 0's
worker) are wired by cmd/run.py. :meth:`PodAgent.run` returns a :class:`RunResult`, torch
elastic's shape: the group's state, and per local rank its exit status or its failure.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ftagent.agent import supervisor
from ftagent.agent.decider import Decider, LocalDecider
from ftagent.agent.supervisor import ChildReaper
from ftagent.agent.worker import Worker
from ftagent.agent.worker_parts import WorkerParts
from ftagent.agent.worker_spec import WorkerSpec
from ftagent.model import TrainerState

if TYPE_CHECKING:
    from ftagent.metrics import AgentMetrics

log = logging.getLogger("ftagent.pod")


@dataclass(frozen=True)
class WorkerFailure:
    """How one worker ended when it did not succeed (torch elastic's ProcessFailure)."""

    local_rank: int
    exit_status: int  # the trainer's code, 128+N for signal N, or --exit-replace/--exit-stop
    state: TrainerState  # FAILED or STOPPED (INIT: the worker itself broke)
    message: str = ""


@dataclass(frozen=True)
class RunResult:
    """What the pod's run came to (torch elastic's RunResult): ``state`` SUCCEEDED when
    every worker's trainer succeeded, STOPPED when the agent was told to stop, else
    FAILED; ``return_values``: local rank -> exit status of the workers that succeeded;
    ``failures``: local rank -> how each other one ended."""

    state: TrainerState
    return_values: dict[int, int] = field(default_factory=dict)
    failures: dict[int, WorkerFailure] = field(default_factory=dict)

    @property
    def exit_status(self) -> int:
        """The agent's exit status: the first failing worker's own (its exit code, 128+N
        for signal N), else 0."""
        return next((self.failures[r].exit_status for r in sorted(self.failures)), 0)


class PodAgent:
    """One agent process's workers and the parts they share (module docstring)."""

    def __init__(self, decider: Decider | None = None) -> None:
        """``decider``: the pod's one decider (default: the local policy)."""
        self.reaper = ChildReaper()  # one SIGCHLD handler reaps every worker's trainer
        self.decider: Decider = decider if decider is not None else LocalDecider()
        self.workers: list[Worker] = []

    @property
    def stop_signal(self) -> int | None:
        """The stop signal the agent was sent, if any (its workers' lifecycles hold it)."""
        return next((w.lifecycle.stop_signal for w in self.workers
                     if w.lifecycle.stop_signal is not None), None)

    def add(self, spec: WorkerSpec, *, metrics: AgentMetrics | None = None,
            parts: Callable[[Worker], WorkerParts] | None = None) -> Worker:
        """A worker for ``spec``, reaped by the pod's reaper, seated at the pod's decider;
        ``metrics``: its series; ``parts``: builds its parts."""
        worker = Worker(spec, reaper=self.reaper, decider=self.decider, metrics=metrics,
                        parts=parts)
        self.workers.append(worker)
        return worker

    def on_signal(self, sig: int) -> None:
        """SIGTERM/SIGINT/SIGHUP to the agent: every worker forwards it to its trainer."""
        for w in self.workers:
            w.on_signal(sig)

    async def run(self) -> RunResult:
        """Run every worker in this process until all are done."""
        if not self.workers:
            return RunResult(TrainerState.SUCCEEDED)
        install_process_parts(self.reaper, self.on_signal)
        try:  # a worker leaves the decider's group when its run ends (decider.close)
            codes = await asyncio.gather(*(w.run() for w in self.workers),
                                         return_exceptions=True)
        finally:
            if supervisor.tree():  # nothing of any trainer outlives the agent
                await supervisor.kill_tree(None)
            self.reaper.uninstall()
        return self._result(codes)

    def _result(self, codes: list[int | BaseException]) -> RunResult:
        values: dict[int, int] = {}
        failures: dict[int, WorkerFailure] = {}
        for rank, (w, c) in enumerate(zip(self.workers, codes, strict=True)):
            if isinstance(c, BaseException):
                log.error("worker failed: %r", c, exc_info=c)
                failures[rank] = WorkerFailure(rank, 1, TrainerState.INIT, repr(c))
            elif c == 0:
                values[rank] = c
            else:
                failures[rank] = WorkerFailure(rank, c, w.state)
        if not failures:
            state = TrainerState.SUCCEEDED
        elif self.stop_signal is not None:
            state = TrainerState.STOPPED
        else:
            state = TrainerState.FAILED
        return RunResult(state, values, failures)


def install_process_parts(reaper: ChildReaper, on_signal: Callable[[int], None]) -> None:
    """What one agent process has once, whatever number of workers it runs: the
    sub-reaper, the SIGCHLD reaper and the stop signals (``on_signal(sig)``)."""
    loop = asyncio.get_running_loop()
    if not supervisor.set_child_subreaper():
        log.warning("PR_SET_CHILD_SUBREAPER failed: orphaned grandchildren may escape")
    reaper.install(loop)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig)

