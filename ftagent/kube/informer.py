"""Informer-style watches: one list + one long watch per resource kind, never per job.

The shape is client-go's reflector: list (in pages), remember the list's resourceVersion,
watch from it, move the version on with every event and BOOKMARK, and re-watch from the
last version when the stream ends (``timeoutSeconds``) or drops. When the server answers
410 (the version left its history) the informer lists again and hands the consumer the
difference between its cache and the fresh list as ADDED / MODIFIED / DELETED, so a delete
that happened while nobody watched is still seen. Errors back off with full jitter
(capped); a 429 waits what ``Retry-After`` says; a 403 is one log line naming the missing
permission, then a slow retry.

Threads: the blocking list/watch runs in one daemon thread per informer. Events reach the
consumer through ``handler``, on the asyncio loop given (``loop.call_soon_threadsafe``) or,
with no loop, in the informer's thread. ``stop()`` returns promptly: it shuts the socket of
a blocked read, and every wait is on an Event. Memory stays bounded by ``project``: the
cache holds what it returns (a small dataclass or dict), not the API objects.

Objects travel as JSON dicts (``_preload_content=False``): 10,000 pods are parsed once by
``json``, never deserialized into the client's model classes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from ftagent.kube.client import forbidden_message, retry_after, send

log = logging.getLogger("ftagent.kube.informer")

T = TypeVar("T")

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
# One watch line (one object) beyond this is refused and the watch restarted: a broken or
# hostile server must not make the arbiter buffer without bound (real objects are < 1.5 MiB).
MAX_LINE = 8 * 1024 * 1024
# Changes handed to the loop per callback: a 10,000-pod list is 40 wake-ups of the loop,
# not 10,000 (each call_soon_threadsafe writes the loop's self-pipe), and no callback
# holds the loop for long (a few ms of handlers each).
DELIVER_BATCH = 250


@dataclass(frozen=True)
class Change(Generic[T]):
    """What the consumer receives: the kind of change, the object's key, the projected
    object (its last known state for DELETED) and the projection it replaces."""

    type: str
    key: str
    obj: T
    old: T | None = None
    relist: bool = False  # found by comparing a fresh list with the cache (after a 410)


@dataclass
class Backoff:
    """Full-jitter exponential backoff: the n-th wait is uniform in
    [0, min(cap, base * 2**n)] (AWS's "full jitter"); pure given ``rng``."""

    base: float = 0.5
    cap: float = 30.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next(self) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(self.attempt, 30)))
        self.attempt += 1
        return self.rng.uniform(0.0, ceiling)

    def reset(self) -> None:
        self.attempt = 0


@dataclass
class Stats:
    """Counters for tests, benches and the arbiter's log."""

    lists: int = 0
    list_pages: int = 0
    watches: int = 0
    relists: int = 0  # lists after the first (410, or an error before any watch)
    events: int = 0
    bookmarks: int = 0
    errors: dict[int, int] = field(default_factory=dict)  # HTTP status (0: transport) -> count
    waits: list[float] = field(default_factory=list)  # the last waits before a retry


class _Gone(Exception):
    """410: the watch's version is older than the server's history."""


class _Refused(Exception):
    """An HTTP error answer (the status and the ApiException for its headers)."""

    def __init__(self, exc: Any, status: int | None = None) -> None:
        self.exc = exc
        self.status = int(status if status is not None else getattr(exc, "status", 0) or 0)
        super().__init__(str(self.status))


def _identity(obj: dict[str, Any]) -> Any:
    return obj


def key_of(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


class Informer(Generic[T]):
    """List + watch of one resource kind with a projected cache (see the module docstring).

    ``list_func`` is the generated client's list method for the kind, e.g.
    ``CoreV1Api(api).list_pod_for_all_namespaces`` or ``CoreV1Api(api).list_node``;
    ``list_args`` its fixed arguments (``namespace=...``); ``label_selector`` /
    ``field_selector`` as kubectl takes them.
    """

    def __init__(self, list_func: Callable[..., Any], *, name: str,
                 handler: Callable[[Change[T]], None] | None = None,
                 project: Callable[[dict[str, Any]], T] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 label_selector: str | None = None, field_selector: str | None = None,
                 list_args: dict[str, Any] | None = None, page_size: int = 500,
                 watch_timeout: int = 300, request_timeout: float = 60.0,
                 backoff: Backoff | None = None, forbidden_retry: float = 60.0,
                 retry_after_cap: float = 300.0) -> None:
        self.name = name
        self._list_func = list_func
        self._handler = handler
        self._project: Callable[[dict[str, Any]], Any] = project or _identity
        self._loop = loop
        self._selectors = {k: v for k, v in (("label_selector", label_selector),
                                             ("field_selector", field_selector)) if v}
        self._args = dict(list_args or {})
        self._page_size = page_size
        self._watch_timeout = watch_timeout
        self._request_timeout = request_timeout
        self._backoff = backoff or Backoff()
        self._forbidden_retry = forbidden_retry
        self._retry_after_cap = retry_after_cap
        self._lock = threading.Lock()
        self._cache: dict[str, T] = {}
        self._versions: dict[str, str] = {}
        self.resource_version: str | None = None
        self.stats = Stats()
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._async_synced: asyncio.Event | None = None
        self._resp: Any = None
        self._thread: threading.Thread | None = None
        self._forbidden_said: set[str] = set()

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        """Start the list/watch thread (once)."""
        if self._thread is not None:
            raise RuntimeError(f"informer {self.name} already started")
        if self._loop is not None:
            self._async_synced = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and join the thread; a blocked read is cut by shutting its socket."""
        self._stop.set()
        self._cut()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def synced(self) -> bool:
        """True once the first full list is in the cache (its ADDED events handed over)."""
        return self._synced.is_set()

    def wait_synced(self, timeout: float | None = None) -> bool:
        """Block the calling thread until synced (not for the event loop's thread)."""
        return self._synced.wait(timeout)

    async def until_synced(self) -> None:
        """Await the first list on the informer's loop (its events were handled first)."""
        if self._async_synced is None:
            raise RuntimeError("until_synced needs an informer started with a loop")
        await self._async_synced.wait()

    def get(self, key: str) -> T | None:
        """The projected object for ``namespace/name`` (``name`` for cluster objects)."""
        with self._lock:
            return self._cache.get(key)

    def items(self) -> list[tuple[str, T]]:
        with self._lock:
            return list(self._cache.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                self._watch()
                self._backoff.reset()
            except _Gone:
                need_list = True  # relist at once, as client-go does
            except _Refused as e:
                self._count(e.status)
                if e.status == 410:
                    if need_list:  # the list itself expired (a stale continue): not in a loop
                        self._wait(self._backoff.next())
                    need_list = True
                    continue
                self._wait(self._delay_for(e))
            except Exception as e:  # transport: reset, refused connection, broken chunk
                if self._stop.is_set():
                    break
                self._count(0)
                log.info("informer %s: %s: %s; retrying", self.name, type(e).__name__,
                         str(e)[:200])
                self._wait(self._backoff.next())

    def _delay_for(self, e: _Refused) -> float:
        if e.status == 403:
            msg = forbidden_message(e.exc)
            if msg not in self._forbidden_said and len(self._forbidden_said) < 16:
                self._forbidden_said.add(msg)
                log.warning("informer %s: forbidden: %s (grant this in the arbiter's "
                            "ClusterRole); decisions go on through the agents, retrying "
                            "every %gs", self.name, msg, self._forbidden_retry)
            return self._forbidden_retry
        if e.status in (429, 503):
            wait = retry_after(e.exc, self._retry_after_cap)
            if wait is not None:
                return wait
        log.info("informer %s: API server answered %d; backing off", self.name, e.status)
        return self._backoff.next()

    def _wait(self, seconds: float) -> None:
        self.stats.waits = (self.stats.waits + [seconds])[-32:]
        self._stop.wait(seconds)

    def _count(self, status: int) -> None:
        self.stats.errors[status] = self.stats.errors.get(status, 0) + 1

    def _call(self, **kw: Any) -> Any:
        from kubernetes.client.rest import ApiException

        try:
            resp = self._list_func(**self._args, **self._selectors, **kw,
                                   _preload_content=False)
        except ApiException as e:  # the generated method raises for most error statuses
            raise _Refused(e) from None
        status = int(getattr(resp, "status", 200))
        if not 200 <= status < 300:
            try:
                raise _Refused(ApiException(http_resp=resp))
            finally:
                resp.release_conn()
        return resp

    # --------------------------------------------------------------------- list
    def _list(self) -> None:
        """List in pages; each page is parsed and projected as it arrives, so at most one
        page of API objects is alive at a time (never the whole list: about 10x its JSON
        as Python objects), whatever the cluster holds."""
        fresh: dict[str, tuple[str, Any]] = {}  # key -> (resourceVersion, projection)
        cont: str | None = None
        rv = ""
        while True:
            kw: dict[str, Any] = {"_request_timeout": self._request_timeout}
            if self._page_size:
                kw["limit"] = self._page_size
            if cont:
                kw["_continue"] = cont
            resp = self._call(**kw)
            try:
                body = json.loads(resp.data)
            finally:
                resp.release_conn()
            self.stats.list_pages += 1
            meta = body.get("metadata") or {} if isinstance(body, dict) else {}
            items = (body.get("items") or []) if isinstance(body, dict) else []
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and isinstance(item.get("metadata"), dict):
                    key = key_of(item)
                    version = str(item["metadata"].get("resourceVersion", ""))
                    with self._lock:  # an unchanged object keeps its projection
                        same = self._versions.get(key) == version and key in self._cache
                        kept = self._cache.get(key) if same else None
                    fresh[key] = (version, kept if same else self._project(item))
            del body, items  # the page's objects go before the next page is read
            rv = str(meta.get("resourceVersion") or rv)
            cont = meta.get("continue") or None
            if not cont or self._stop.is_set():
                break
        self.stats.lists += 1
        if self.stats.lists > 1:
            self.stats.relists += 1
        self._replace(fresh, rv)

    def _replace(self, fresh: dict[str, tuple[str, Any]], rv: str) -> None:
        """Swap the cache for a fresh list (projected); hand over the difference."""
        changes: list[Change[T]] = []
        first = not self._synced.is_set()
        with self._lock:
            for key in [k for k in self._cache if k not in fresh]:
                old = self._cache.pop(key)
                self._versions.pop(key, None)
                changes.append(Change(DELETED, key, old, old, relist=True))
            for key, (version, obj) in fresh.items():
                if self._versions.get(key) == version and key in self._cache:
                    continue
                old_obj = self._cache.get(key)
                typ = MODIFIED if key in self._cache else ADDED
                self._cache[key], self._versions[key] = obj, version
                changes.append(Change(typ, key, obj, old_obj, relist=not first))
            self.resource_version = rv
        self._deliver(changes)
        if first:
            self._mark_synced()

    def _mark_synced(self) -> None:
        self._synced.set()
        if self._loop is not None and self._async_synced is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                self._loop.call_soon_threadsafe(self._async_synced.set)

    # -------------------------------------------------------------------- watch
    def _watch(self) -> None:
        resp = self._call(watch=True, resource_version=self.resource_version,
                          allow_watch_bookmarks=True, timeout_seconds=self._watch_timeout,
                          _request_timeout=(self._request_timeout,
                                            self._watch_timeout + self._request_timeout))
        self.stats.watches += 1
        self._resp = resp
        started, healthy = time.monotonic(), False
        try:
            if self._stop.is_set():
                return
            for line in _lines(resp):
                if self._stop.is_set():
                    return
                self._on_line(line)
                healthy = True
        finally:
            if healthy or time.monotonic() - started >= 10.0:
                self._backoff.reset()  # a drop after a working watch starts from the base
            self._resp = None
            resp.close()  # a half-read stream must not go back to the pool as reusable
            resp.release_conn()

    def _on_line(self, line: bytes) -> None:
        try:
            ev = json.loads(line)
        except ValueError:
            log.info("informer %s: a watch line is not JSON (%d bytes); skipped", self.name,
                     len(line))
            return
        if not isinstance(ev, dict) or not isinstance(ev.get("object"), dict):
            return
        typ, obj = ev.get("type"), ev["object"]
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        if typ == "ERROR":
            code = int(obj.get("code") or 0) if str(obj.get("code", "")).isdigit() else 0
            if code == 410:
                raise _Gone()
            raise _Refused(None, code)  # in-stream error: back off as for an answer
        version = meta.get("resourceVersion")
        if typ == "BOOKMARK":
            if version:
                self.resource_version = str(version)
            self.stats.bookmarks += 1
            return
        if typ not in (ADDED, MODIFIED, DELETED) or not meta.get("name"):
            return
        key = key_of(obj)
        change: Change[T] | None = None
        with self._lock:
            known = key in self._cache  # (a projection may be None or falsy)
            if typ == DELETED:
                old = self._cache.pop(key, None)
                self._versions.pop(key, None)
                if known:
                    change = Change(DELETED, key, self._project(obj), old)
            elif self._versions.get(key) != str(version):  # a replayed event is no change
                new = self._project(obj)
                old = self._cache.get(key)
                self._cache[key], self._versions[key] = new, str(version)
                change = Change(MODIFIED if known else ADDED, key, new, old)
            if version:
                self.resource_version = str(version)
        self.stats.events += 1
        if change is not None:
            self._deliver([change])

    def _deliver(self, changes: list[Change[T]]) -> None:
        if not changes or self._handler is None:
            return
        if self._loop is None:
            for c in changes:
                self._safe_handle(c)
            return
        try:  # a list's changes in batches: one wake-up of the loop each, not one per pod
            for i in range(0, len(changes), DELIVER_BATCH):
                self._loop.call_soon_threadsafe(self._handle_batch,
                                                changes[i:i + DELIVER_BATCH])
        except RuntimeError:
            self._stop.set()  # the loop is closed: the consumer is gone

    def _handle_batch(self, changes: list[Change[T]]) -> None:
        for c in changes:
            self._safe_handle(c)

    def _safe_handle(self, change: Change[T]) -> None:
        try:
            assert self._handler is not None
            self._handler(change)
        except Exception:  # a consumer bug must not end the watch
            log.exception("informer %s: handler failed on %s %s", self.name, change.type,
                          change.key)

    def _cut(self) -> None:
        resp = self._resp
        if resp is None:
            return
        try:
            sock = getattr(getattr(resp, "connection", None), "sock", None)
            if sock is not None:
                import socket

                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _lines(resp: Any) -> Iterator[bytes]:
    """Newline-delimited watch events from a chunked response, each bounded by MAX_LINE."""
    buf = bytearray()
    for seg in resp.stream(amt=None, decode_content=False):
        buf.extend(seg if isinstance(seg, bytes) else str(seg).encode())
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line = bytes(buf[:nl])
            del buf[:nl + 1]
            if line.strip():
                yield line
        if len(buf) > MAX_LINE:
            raise ValueError(f"a watch event over {MAX_LINE} bytes")
    if buf.strip():
        yield bytes(buf)


# The list/watch parameters an Informer passes, as the API server names them.
_QUERY = {"label_selector": "labelSelector", "field_selector": "fieldSelector",
          "limit": "limit", "_continue": "continue", "watch": "watch",
          "resource_version": "resourceVersion", "timeout_seconds": "timeoutSeconds",
          "allow_watch_bookmarks": "allowWatchBookmarks"}


def collection(api: Any, path: str) -> Callable[..., Any]:
    """A list/watch call of the collection at ``path`` (``/api/v1/pods``) through the
    ``kubernetes`` ApiClient ``api``, as the generated ``list_*`` methods make it with
    ``_preload_content=False`` (the same URL, query, auth, Accept, urllib3 response, and
    ApiException for a non-2xx answer), without importing a generated API class: those
    import their hundreds of pydantic models (``CoreV1Api``: about half a second of CPU),
    and a (re)started arbiter lists its pods before it needs any of them."""
    def call(*, _preload_content: bool = False, _request_timeout: Any = None,
             **params: Any) -> Any:
        query = [(_QUERY[k], v) for k, v in params.items() if v is not None]
        return send(api, "GET", path, query=query, timeout=_request_timeout)

    return call


def pod_informer(api: Any, *, label_selector: str | None = None, namespace: str | None = None,
                 **kw: Any) -> Informer[Any]:
    """Pods of every namespace (or one) matching ``label_selector``: one list + one watch."""
    if namespace:
        return Informer(collection(api, f"/api/v1/namespaces/{quote(namespace, safe='')}/pods"),
                        name=f"pods/{namespace}", label_selector=label_selector, **kw)
    return Informer(collection(api, "/api/v1/pods"), name="pods",
                    label_selector=label_selector, **kw)


def node_informer(api: Any, **kw: Any) -> Informer[Any]:
    """All nodes: one list + one watch."""
    return Informer(collection(api, "/api/v1/nodes"), name="nodes", **kw)

