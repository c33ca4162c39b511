"""Errors as the API server words them (``Status`` objects), and the two views of Events."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from .resources import Kind

Obj = dict[str, Any]


class ApiError(Exception):
    """An error the server answers with a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str,
                 details: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = details
        self.headers = headers or {}

    def status(self) -> Obj:
        s: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": self.message, "reason": self.reason, "code": self.code}
        if self.details is not None:
            s["details"] = self.details
        return s


def details(kind: Kind, name: str) -> Obj:
    d: Obj = {"name": name, "kind": kind.plural}
    if kind.group:
        d["group"] = kind.group
    return d


def not_found(kind: Kind, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{kind.qualified} "{name}" not found', details(kind, name))


def conflict(kind: Kind, name: str, why: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {kind.qualified} '
                    f'"{name}": {why}', details(kind, name))


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def now_rfc3339(clock: Callable[[], float] | None = None) -> str:
    t = dt.datetime.now(dt.timezone.utc) if clock is None else \
        dt.datetime.fromtimestamp(clock(), dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


# core/v1 Event field <-> events.k8s.io/v1 Event field (both views of one stored object)
_EVENT_FIELDS = [("message", "note"), ("involvedObject", "regarding"), ("related", "related"),
                 ("reportingComponent", "reportingController"),
                 ("reportingInstance", "reportingInstance"), ("source", "deprecatedSource"),
                 ("firstTimestamp", "deprecatedFirstTimestamp"),
                 ("lastTimestamp", "deprecatedLastTimestamp"), ("count", "deprecatedCount"),
                 ("eventTime", "eventTime"), ("series", "series"), ("action", "action"),
                 ("reason", "reason"), ("type", "type")]


def to_storage(kind: Kind, obj: Obj) -> Obj:
    if kind.store_key == "events" and kind.group == "events.k8s.io":
        out = {"metadata": obj.get("metadata", {})}
        for core, new in _EVENT_FIELDS:
            if new in obj:
                out[core] = obj[new]
        return out
    return obj


def to_view(kind: Kind, obj: Obj) -> Obj:
    """The object as ``kind``'s API shows it (with its apiVersion and kind)."""
    if kind.store_key == "events" and kind.group == "events.k8s.io":
        out: Obj = {"metadata": obj.get("metadata", {})}
        for core, new in _EVENT_FIELDS:
            if core in obj:
                out[new] = obj[core]
        out.setdefault("eventTime", None)  # MicroTime without omitempty: null, as served
    else:
        out = dict(obj)
    out["apiVersion"], out["kind"] = kind.api_version, kind.kind
    return out
