"""The object store behind the fake API server: resourceVersions, writes, history, watches.

One global resourceVersion counter (a string on the wire, as etcd's revision is), bumped by
every write of any kind; a bounded history of write events that watches replay from a
resourceVersion (a version older than the history is 410 Expired, in-stream for a watch,
as on the real server); writes replace objects (never mutate them in place), so history
entries and list snapshots share objects without copying.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import random
import string
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import patch as patches
from . import validate
from .errors import (
    ApiError,
    Obj,
    conflict,
    details,
    gone,
    not_found,
    now_rfc3339,
    to_storage,
    to_view,
)
from .resources import Kind, Requirement, selected


@dataclass
class WriteEvent:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    store_key: str
    namespace: str
    obj: Obj
    old: Obj | None


@dataclass
class Watcher:
    """One open watch: its filter and how far it has read the history."""

    kind: Kind
    namespace: str | None
    labels: list[Requirement]
    fields: list[tuple[str, str, str]]
    pos: int
    epoch: int
    pending: list[Obj] = field(default_factory=list)  # synthetic initial events

    def match(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        if self.namespace and (obj.get("metadata") or {}).get("namespace") != self.namespace:
            return False
        return selected(obj, self.labels, self.fields)


class Dropped(Exception):
    """The fake was told to drop every open watch."""


class Store:
    """Objects by (store key, namespace, name); see the module docstring."""

    def __init__(self, history: int = 1000, clock: Callable[[], float] | None = None) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.rv = 0
        self.compacted_rv = 0  # events at or below this are gone from history
        self.history: deque[WriteEvent] = deque()
        self.history_size = history
        self.epoch = 0  # bumped to drop every open watch
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {}
        self.watchers: list[Watcher] = []  # open watches, registered by the HTTP side
        self.clock = clock
        # feature gates on (validate.GATES): a disabled one's fields are dropped or refused
        # on a pod's create, as the real server does
        self.gates: set[str] = set(validate.GATES)

    # ----------------------------------------------------------------- internals
    def _bucket(self, kind: Kind) -> dict[tuple[str, str], Obj]:
        return self.objects.setdefault(kind.store_key, {})

    def _record(self, kind: Kind, type_: str, ns: str, obj: Obj, old: Obj | None) -> None:
        self.history.append(WriteEvent(self.rv, type_, kind.store_key, ns, obj, old))
        while len(self.history) > self.history_size:
            self.compacted_rv = self.history.popleft().rv
        self.changed.notify_all()

    def _bump(self, obj: Obj) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def _key(self, kind: Kind, ns: str | None, name: str) -> tuple[str, str]:
        return ((ns or "") if kind.namespaced else "", name)

    def _existing(self, kind: Kind, ns: str | None, name: str) -> Obj:
        obj = self._bucket(kind).get(self._key(kind, ns, name))
        if obj is None:
            raise not_found(kind, name)
        return obj

    # --------------------------------------------------------------------- verbs
    def create(self, kind: Kind, ns: str | None, body: Obj) -> Obj:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of the request was not an object")
        obj = copy.deepcopy(to_storage(kind, body))
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "BadRequest", "metadata must be an object")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                random.choices(string.ascii_lowercase + string.digits, k=5))
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", f'{kind.kind} "" is invalid: metadata.name: '
                           "Required value: name or generateName is required",
                           {"kind": kind.kind, "causes": [{"reason": "FieldValueRequired",
                            "message": "Required value: name or generateName is required",
                            "field": "metadata.name"}]})
        if kind.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does "
                               "not match the namespace sent on the request")
            meta["namespace"] = ns or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        validate.device_taint_rule(kind, obj)
        validate.resource_slice(kind, obj)
        validate.pod_spec(kind, obj, self.gates)
        with self.lock:
            key = self._key(kind, meta.get("namespace"), name)
            if key in self._bucket(kind):
                raise ApiError(409, "AlreadyExists", f'{kind.qualified} "{name}" already exists',
                               details(kind, name))
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339(self.clock)
            if kind.status or kind.custom:
                meta["generation"] = 1  # kinds with a spec count its changes
            for k in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(k, None)
            if kind.plural == "pods" and not kind.group:
                obj.setdefault("status", {}).setdefault("phase", "Pending")
            self._bump(obj)
            self._bucket(kind)[key] = obj
            self._record(kind, "ADDED", key[0], obj, None)
            return to_view(kind, obj)

    def get(self, kind: Kind, ns: str | None, name: str) -> Obj:
        with self.lock:
            return to_view(kind, self._existing(kind, ns, name))

    def list_objects(self, kind: Kind, ns: str | None, labels: list[Requirement],
             fields: list[tuple[str, str, str]], limit: int | None = None,
             cont: str | None = None, rv: str | None = None,
             rv_match: str | None = None) -> Obj:
        with self.lock:
            list_rv = self.rv
            start: tuple[str, str] | None = None
            if cont:
                try:
                    tok = json.loads(base64.urlsafe_b64decode(cont.encode()))
                    list_rv, start = int(tok["rv"]), (tok["ns"], tok["name"])
                except (ValueError, KeyError, TypeError) as e:
                    raise ApiError(400, "BadRequest", f"continue key is not valid: {e}") from e
                if list_rv < self.compacted_rv:
                    raise gone("The provided continue parameter is too old to display a "
                               "consistent list result. You can start a new list without "
                               "the continue parameter.")
            elif rv not in (None, "", "0"):
                want = _parse_rv(rv)
                if rv_match == "Exact" and want < self.rv:
                    # this fake keeps no old snapshots: an exact read of the past is expired
                    raise gone(f"too old resource version: {want} ({self.compacted_rv + 1})")
                if want > self.rv:
                    raise ApiError(504, "Timeout", f"Too large resource version: {want}, "
                                   f"current: {self.rv}", {"causes": [
                                       {"reason": "ResourceVersionTooLarge",
                                        "message": "Too large resource version"}],
                                       "retryAfterSeconds": 1})
            items: list[Obj] = []
            for key in sorted(self._bucket(kind)):
                if start is not None and key <= start:
                    continue
                obj = self._bucket(kind)[key]
                if ns and kind.namespaced and key[0] != ns:
                    continue
                if not selected(obj, labels, fields):
                    continue
                if limit and len(items) == limit:
                    tok = {"rv": list_rv, "ns": items[-1]["metadata"].get("namespace", ""),
                           "name": items[-1]["metadata"]["name"]}
                    return self._list_obj(kind, items, list_rv, base64.urlsafe_b64encode(
                        json.dumps(tok).encode()).decode())
                items.append(obj)
            return self._list_obj(kind, items, list_rv, None)

    def _list_obj(self, kind: Kind, items: list[Obj], rv: int, cont: str | None) -> Obj:
        meta: Obj = {"resourceVersion": str(rv)}
        if cont:
            meta["continue"] = cont
        views = [to_view(kind, o) for o in items]
        return {"kind": f"{kind.kind}List", "apiVersion": kind.api_version, "metadata": meta,
                "items": views}

    def update(self, kind: Kind, ns: str | None, name: str, body: Obj,
               subresource: str | None = None) -> Obj:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "BadRequest", "the body of the request was not an object")
        new = copy.deepcopy(to_storage(kind, body))
        meta = new.setdefault("metadata", {})
        if meta.get("name") not in (None, name):
            raise ApiError(400, "BadRequest", f"the name of the object ({meta.get('name')}) "
                           f"does not match the name on the URL ({name})")
        with self.lock:
            old = self._existing(kind, ns, name)
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
                raise conflict(kind, name, "the object has been modified; please apply your "
                               "changes to the latest version and try again")
            if meta.get("uid") not in (None, old["metadata"]["uid"]):
                raise conflict(kind, name, f"Precondition failed: UID in precondition: "
                               f"{meta.get('uid')}, UID in object meta: {old['metadata']['uid']}")
            return self._write(kind, old, new, subresource)

    def patch(self, kind: Kind, ns: str | None, name: str, content_type: str, body: Any,
              subresource: str | None = None) -> Obj:
        ctype = content_type.split(";")[0].strip().lower()
        with self.lock:
            old = self._existing(kind, ns, name)
            view = to_view(kind, old)
            try:
                if ctype == "application/merge-patch+json":
                    new = patches.merge_patch(view, body)
                elif ctype == "application/json-patch+json":
                    new = patches.json_patch(view, body)
                elif ctype == "application/strategic-merge-patch+json" and not kind.custom:
                    new = patches.strategic_merge_patch(view, body)
                else:
                    accepted = "application/json-patch+json, application/merge-patch+json"
                    if not kind.custom:
                        accepted += ", application/strategic-merge-patch+json"
                    raise ApiError(415, "UnsupportedMediaType",
                                   f"the body of the request was in an unknown format - "
                                   f"accepted media types include: {accepted}")
            except patches.PatchError as e:
                raise ApiError(422, "Invalid", str(e), details(kind, name)) from e
            if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
                raise ApiError(422, "Invalid", "the patched object must have metadata",
                               details(kind, name))
            sent_rv = (body.get("metadata") or {}).get("resourceVersion") \
                if isinstance(body, dict) and isinstance(body.get("metadata"), dict) else None
            if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
                raise conflict(kind, name, "the object has been modified; please apply your "
                               "changes to the latest version and try again")
            return self._write(kind, old, to_storage(kind, new), subresource)

    def _write(self, kind: Kind, old: Obj, new: Obj, subresource: str | None) -> Obj:
        """Store ``new`` over ``old`` keeping what the caller may not change; a no-op write
        keeps the resourceVersion and sends no event, as the real server does."""
        new = copy.deepcopy(new)
        if subresource == "status":
            merged = copy.deepcopy(old)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            new = merged
        elif kind.status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        meta, ometa = new.setdefault("metadata", {}), old["metadata"]
        for k in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                  "deletionGracePeriodSeconds", "generation", "resourceVersion"):
            if k in ometa:
                meta[k] = ometa[k]
            else:
                meta.pop(k, None)
        for k in ("apiVersion", "kind"):
            new.pop(k, None)
        if new == old:
            return to_view(kind, old)
        validate.pod(kind, new)
        validate.device_taint_rule(kind, new)
        validate.resource_slice(kind, new)
        spec_keys = set(new) | set(old)
        if "generation" in ometa and any(new.get(k) != old.get(k)
                                         for k in spec_keys - {"metadata", "status"}):
            meta["generation"] = int(ometa.get("generation", 1)) + 1
        key = self._key(kind, meta.get("namespace"), meta["name"])
        terminating_pod = kind.plural == "pods" and not kind.group and \
            meta.get("deletionGracePeriodSeconds")
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not terminating_pod:
            return self._remove(kind, key, new)
        self._bump(new)
        self._bucket(kind)[key] = new
        self._record(kind, "MODIFIED", key[0], new, old)
        return to_view(kind, new)

    def _remove(self, kind: Kind, key: tuple[str, str], last: Obj) -> Obj:
        old = self._bucket(kind).pop(key)
        last = dict(last)
        last["metadata"] = dict(last["metadata"])
        self._bump(last)
        self._record(kind, "DELETED", key[0], last, old)
        return to_view(kind, last)

    def delete(self, kind: Kind, ns: str | None, name: str, grace: int | None = None,
               preconditions: Obj | None = None) -> Obj:
        with self.lock:
            old = self._existing(kind, ns, name)
            meta = old["metadata"]
            pre = preconditions or {}
            if pre.get("uid") and pre["uid"] != meta["uid"]:
                raise conflict(kind, name, f"Precondition failed: UID in precondition: "
                               f"{pre['uid']}, UID in object meta: {meta['uid']}")
            if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
                raise conflict(kind, name, f"Precondition failed: ResourceVersion in "
                               f"precondition: {pre['resourceVersion']}, ResourceVersion in "
                               f"object meta: {meta['resourceVersion']}")
            key = self._key(kind, ns, name)
            is_pod = kind.plural == "pods" and not kind.group
            if is_pod:
                if grace is None:
                    grace = int((old.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
                phase = (old.get("status") or {}).get("phase")
                if not (old.get("spec") or {}).get("nodeName") or phase in ("Succeeded",
                                                                            "Failed"):
                    grace = 0  # never scheduled or already finished: nothing to wait for
            else:
                grace = 0
            if grace <= 0 and not meta.get("finalizers"):
                return self._remove(kind, key, old)
            current = meta.get("deletionGracePeriodSeconds")
            if meta.get("deletionTimestamp") and (current is None or grace >= current):
                return to_view(kind, old)  # already terminating, no shorter grace asked
            new = copy.deepcopy(old)
            base = self.clock() if self.clock else dt.datetime.now(dt.timezone.utc).timestamp()
            new["metadata"]["deletionTimestamp"] = now_rfc3339(lambda: base + grace)
            new["metadata"]["deletionGracePeriodSeconds"] = grace
            self._bump(new)
            self._bucket(kind)[key] = new
            self._record(kind, "MODIFIED", key[0], new, old)
            return to_view(kind, new)

    def finish_termination(self, kind: Kind, ns: str | None, name: str) -> Obj:
        """What the kubelet does once the containers have stopped: delete with grace 0."""
        with self.lock:
            old = self._existing(kind, ns, name)
            if old["metadata"].get("finalizers"):
                new = copy.deepcopy(old)
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                self._bump(new)
                self._bucket(kind)[self._key(kind, ns, name)] = new
                self._record(kind, "MODIFIED", self._key(kind, ns, name)[0], new, old)
                return to_view(kind, new)
            return self._remove(kind, self._key(kind, ns, name), old)

    # --------------------------------------------------------------------- watch
    def open_watch(self, kind: Kind, ns: str | None, labels: list[Requirement],
                   fields: list[tuple[str, str, str]], rv: str | None) -> Watcher:
        with self.lock:
            w = Watcher(kind, ns if kind.namespaced else None, labels, fields, self.rv,
                        self.epoch)
            if rv in (None, "", "0"):
                for key in sorted(self._bucket(kind)):
                    obj = self._bucket(kind)[key]
                    if w.match(obj):
                        w.pending.append({"type": "ADDED", "object": to_view(kind, obj)})
                return w
            want = _parse_rv(rv)
            if want < self.compacted_rv:
                raise gone(f"too old resource version: {want} ({self.compacted_rv + 1})")
            w.pos = want
            return w

    def next_events(self, w: Watcher, wait: float) -> list[Obj]:
        """Events for ``w`` after its position, waiting up to ``wait`` s for one; raises
        :class:`Dropped` when watches were dropped and :class:`ApiError` 410 when the
        history moved past the watcher."""
        with self.lock:
            if w.pending:
                out, w.pending = w.pending, []
                return out
            end = self.rv
            if w.epoch == self.epoch and not self._has_after(w):
                self.changed.wait(wait)
            if w.epoch != self.epoch:
                raise Dropped()
            if w.pos < self.compacted_rv:
                raise gone(f"too old resource version: {w.pos} ({self.compacted_rv + 1})")
            out = []
            for ev in self._events_after(w.pos):
                if ev.store_key != w.kind.store_key:
                    continue
                was, now = w.match(ev.old), w.match(ev.obj)
                if ev.type == "DELETED":
                    typ = "DELETED" if was or now else None
                elif was and now:
                    typ = "MODIFIED"
                elif now:
                    typ = "ADDED"
                elif was:
                    typ = "DELETED"
                else:
                    typ = None
                if typ:
                    out.append({"type": typ, "object": to_view(w.kind, ev.obj)})
            end = self.rv
            w.pos = end
            return out

    def bookmark(self, w: Watcher) -> Obj:
        with self.lock:
            return {"type": "BOOKMARK", "object": {
                "kind": w.kind.kind, "apiVersion": w.kind.api_version,
                "metadata": {"resourceVersion": str(w.pos)}}}

    def _has_after(self, w: Watcher) -> bool:
        return self.rv > w.pos

    def _events_after(self, pos: int) -> list[WriteEvent]:
        out: list[WriteEvent] = []
        for ev in reversed(self.history):
            if ev.rv <= pos:
                break
            out.append(ev)
        out.reverse()
        return out

    def register(self, w: Watcher) -> None:
        with self.lock:
            self.watchers.append(w)
            self.changed.notify_all()

    def unregister(self, w: Watcher) -> None:
        with self.lock:
            if w in self.watchers:
                self.watchers.remove(w)
            self.changed.notify_all()

    def drop_watches(self) -> None:
        with self.lock:
            self.epoch += 1
            self.changed.notify_all()

    def compact(self) -> None:
        """Forget the whole history: every watch or list from an older version gets 410."""
        with self.lock:
            self.history.clear()
            self.compacted_rv = self.rv
            self.changed.notify_all()

    def wake(self) -> None:
        with self.lock:
            self.changed.notify_all()


def _parse_rv(rv: str) -> int:
    try:
        v = int(rv)
    except ValueError:
        raise ApiError(400, "BadRequest", f'resourceVersion: Invalid value: "{rv}": '
                       "strconv.ParseUint: parsing: invalid syntax") from None
    if v < 0:
        raise ApiError(400, "BadRequest", f'resourceVersion: Invalid value: "{rv}"')
    return v
