"""What one worker runs and how: a value built once by the composition root (cmd/run.py).

Its own module, so that the pod (pod.py), the launcher's wiring and the tests name a
worker's specification without importing the worker that runs it (torch elastic keeps its
``WorkerSpec`` apart from the agent in the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ftagent.config import RunConfig

if TYPE_CHECKING:
    from ftagent.agent.tee import Writer


def no_attempt_env(attempt: int) -> dict[str, str]:
    """No per-attempt variables (alone; the launcher adds torchrun's)."""
    return {}


def console(attempt: int) -> tuple[int | Writer, int | Writer]:
    """The trainer's output goes to the agent's own stdout and stderr, as is."""
    return 1, 2


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker runs and how (torch elastic's spec, apart from the running
    state): a value, built once by cmd/run.py and never changed."""

    cfg: RunConfig
    environ: Mapping[str, str] = field(default_factory=dict)
    local_rank: int | None = None  # under the launcher (--nproc-per-node); None: alone
    # per attempt: environment on top of the worker's own (torchrun's restart count);
    # None: none (no_attempt_env)
    attempt_env: Callable[[int], Mapping[str, str]] | None = None
    # per attempt: where stdout/stderr go (fds as is, or the launcher's WorkerOutput);
    # None: the agent's own stdout and stderr, as is (console)
    outputs: Callable[[int], tuple[int | Writer, int | Writer]] | None = None
