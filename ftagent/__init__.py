"""ftagent: a fault-tolerance agent for distributed training.

For trainers, ``import ftagent`` is the SDK: ``ftagent.step(n, loss=...)``,
``with ftagent.phase("checkpoint"): ...``, ``ftagent.collective(op, nbytes, seconds, n)``,
``ftagent.resumed(step)`` after loading a checkpoint.
They are no-ops when the process does not run under ``ftagent run`` and never raise.
Importing this package stays cheap: nothing heavy is imported until used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_SDK_NAMES = ("step", "phase", "collective", "resumed")


def __getattr__(name: str) -> Any:
    if name in _SDK_NAMES:
        from ftagent import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'ftagent' has no attribute {name!r}")
