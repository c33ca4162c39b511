"""Reads a pod's controller chain from the API server, for ``membership.py``: each owner
read by name, its uid checked against the reference, its world size read from its spec.

Blocking reads run on one worker thread (never the event loop); results are cached per
controller uid (bounded, oldest forgotten first) and picked up by the loop with ``take``.
A chain is at most three links (Pod -> batch Job -> JobSet -> TrainJob); one object is at
most ``MAX_OWNER_BYTES``. What the answers mean:

* the owner read, uid as referenced: the link holds (climb on from it);
* 404, or another uid (deleted, recreated under the same name): the link is broken, the
  pod has no job root;
* 403 (no RBAC on that kind): the reference is taken as it stands, with no world size,
  marked unverified (a verified root of the same name outranks it: membership.py);
* anything else (5xx, transport): not cached, asked again at the next pod event.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ftagent.kube.membership import CLIMB, KIND_RANK, Ref, Root, controller_ref, world_from_spec

log = logging.getLogger("ftagent.kube.owners")

MAX_OWNER_BYTES = 1 << 20
KEPT = 10_000
_BROKEN = "broken"


class OwnerChains:
    def __init__(self, api_client: Any, timeout: float = 10.0,
                 fetch: Callable[[str, Ref], tuple[int, Any]] | None = None) -> None:
        self.api_client, self.timeout = api_client, timeout
        self._fetch = fetch or self._read
        self._lock = threading.Lock()
        self._roots: OrderedDict[str, Root | None] = OrderedDict()  # controller uid -> root
        self._asked: set[str] = set()
        self._done: list[tuple[str, Root | None]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ftagent-kube-owners")
        self.reads = 0

    def known(self, uid: str) -> tuple[bool, Root | None]:
        """(resolved, root) for a controller uid."""
        with self._lock:
            if uid in self._roots:
                return True, self._roots[uid]
        return False, None

    def ask(self, namespace: str, ref: Ref) -> None:
        """Resolve ``ref`` (a pod's controller) in the background, once at a time."""
        with self._lock:
            if ref.uid in self._roots or ref.uid in self._asked:
                return
            self._asked.add(ref.uid)
        with contextlib.suppress(RuntimeError):  # shut down
            self._pool.submit(self._resolve, namespace, ref)

    def take(self) -> list[tuple[str, Root | None]]:
        """Chains resolved since the last call (on the loop)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _resolve(self, namespace: str, ref: Ref) -> None:
        root: Root | None = None
        ok = True
        try:
            root = self._climb(namespace, ref)
        except Exception as e:  # transport, 5xx: ask again later
            ok = False
            log.info("reading the owners of %s %s/%s: %s", ref.kind, namespace, ref.name,
                     str(e)[:200])
        with self._lock:
            self._asked.discard(ref.uid)
            if ok:
                self._roots[ref.uid] = root
                while len(self._roots) > KEPT:
                    self._roots.popitem(last=False)
                self._done.append((ref.uid, root))

    def _climb(self, namespace: str, ref: Ref) -> Root | None:
        cur = ref
        for _ in range(3):
            status, obj = self._fetch(namespace, cur)
            self.reads += 1
            if status == 403:
                return Root(cur.group, cur.kind, cur.name, cur.uid, verified=False)
            if status != 200 or not isinstance(obj, dict):
                if status in (404, 410) or status == 200:
                    return None
                raise OSError(f"{status} reading {cur.kind} {cur.name}")
            uid = (obj.get("metadata") or {}).get("uid") if isinstance(obj.get("metadata"),
                                                                        dict) else None
            if uid != cur.uid:
                return None  # recreated under the same name: not the pod's owner
            here = Root(cur.group, cur.kind, cur.name, cur.uid,
                        world_from_spec(cur.group, cur.kind, obj))
            up = controller_ref(obj) if (cur.group, cur.kind) in CLIMB else None
            if up is None or (up.group, up.kind) not in KIND_RANK:
                return here
            cur = up
        return Root(cur.group, cur.kind, cur.name, cur.uid, verified=False)

    def _read(self, namespace: str, ref: Ref) -> tuple[int, Any]:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        resp: Any
        plural = ref.kind.lower() + "s"
        try:
            resp = client.CustomObjectsApi(self.api_client).get_namespaced_custom_object(
                ref.group, ref.version, namespace, plural, ref.name,
                _preload_content=False, _request_timeout=self.timeout)
        except ApiException as e:
            return int(e.status or 0), None
        raw = resp.data[:MAX_OWNER_BYTES + 1]
        if len(raw) > MAX_OWNER_BYTES:
            return 200, None
        return 200, json.loads(raw)
