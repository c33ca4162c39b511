"""The arbiter's DRA watches (resource.k8s.io/v1): ResourceSlices (the drivers' device
taints), ResourceClaims (which pod holds which device) and ftagent's own DeviceTaintRules
(what the breaker holds). Each is an ``informer.Informer`` handing its changes to the
cluster on the loop. On a cluster without DRA the list answers 404 and the informer backs
off and retries (one log line per try at INFO): nothing else changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ftagent.kube.informer import Informer, collection

MANAGED = "app.kubernetes.io/managed-by=ftagent"

Handler = Callable[[str, Any], None]


def dra_informers(api: Any, loop: asyncio.AbstractEventLoop, on_slice: Handler,
                  on_claim: Handler, on_rule: Handler) -> list[Informer[Any]]:
    """Three informers, not started."""
    def at(kind: str) -> Callable[..., Any]:  # (no ResourceV1Api: informer.collection)
        return collection(api, f"/apis/resource.k8s.io/v1/{kind}")

    return [
        Informer(at("resourceslices"), name="resourceslices", loop=loop,
                 handler=lambda c: on_slice(c.type, c.obj)),
        Informer(at("resourceclaims"), name="resourceclaims",
                 loop=loop, handler=lambda c: on_claim(c.type, c.obj)),
        Informer(at("devicetaintrules"), name="devicetaintrules", loop=loop,
                 label_selector=MANAGED, handler=lambda c: on_rule(c.type, c.obj)),
    ]


__all__ = ["MANAGED", "dra_informers"]
