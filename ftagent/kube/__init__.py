"""Everything that speaks Kubernetes: the admission webhook that injects the agent into
training pods (``webhook``: the HTTPS edge; ``inject``: the pure pod mutation; ``identity``:
who a pod is from its job's labels and environment; ``certs``: serving certificates).

Nothing here is imported by the agent: ``ftagent run`` stays free of Kubernetes code.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any


def _lean_kubernetes() -> None:
    """Make ``import kubernetes.client`` import the client alone.

    The ``kubernetes`` package's ``__init__`` imports every part of it (the dynamic
    client and its JSON-schema validation, websockets' stream, leader election, its
    informer, utils): a quarter of a cold ``ftagent arbiter --kube`` start before it
    listens, at a failover too, for parts ftagent never uses. Here the package is
    registered without running its ``__init__``: its submodules import as usual
    (``from kubernetes import client``), and any other attribute imports the submodule of
    that name when first read (``kubernetes.watch``), so nothing that used them breaks."""
    if "kubernetes" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("kubernetes")
    except (ImportError, ValueError):
        return
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return  # not installed (the agent's bundle): imports fail where they are made
    module = importlib.util.module_from_spec(spec)  # __path__ set, __init__ not run

    def __getattr__(name: str) -> Any:
        if name == "__version__":
            from importlib.metadata import version

            return version("kubernetes")
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"kubernetes.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'kubernetes' has no attribute {name!r}") from None

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules["kubernetes"] = module


_lean_kubernetes()
