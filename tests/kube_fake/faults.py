"""Failure injection and the request log of the fake API server.

Rules match a request by RBAC verb (get, list, watch, create, update, patch, delete,
deletecollection, or ``*``) and resource as RBAC names it (``pods``, ``pods/status``,
``nodes``, ``leases.coordination.k8s.io``, ``pytorchjobs.kubeflow.org``, or ``*``), optionally
namespace and name. The first matching rule answers; ``times`` counts down (None = forever).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError


@dataclass
class Request:
    """One request as the server saw it."""

    verb: str
    resource: str  # RBAC form, e.g. "pods", "pods/status", "leases.coordination.k8s.io"
    namespace: str | None
    name: str | None
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    at: float = field(default_factory=time.monotonic)
    code: int = 0  # the status code answered (0 while in flight)


@dataclass
class Rule:
    verb: str
    resource: str
    namespace: str | None
    name: str | None
    code: int
    reason: str
    message: str | None
    retry_after: int | None
    times: int | None

    def matches(self, req: Request) -> bool:
        return (self.verb in ("*", req.verb) and self.resource in ("*", req.resource)
                and self.namespace in (None, req.namespace) and self.name in (None, req.name))


_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            409: "Conflict", 410: "Expired", 422: "Invalid", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


class Faults:
    """The rules and the request log (thread-safe)."""

    def __init__(self, user: str = "system:serviceaccount:ftagent:arbiter") -> None:
        self.user = user
        self.rules: list[Rule] = []
        self.requests: list[Request] = []
        self.lock = threading.Condition()
        self.delays: list[tuple[str, str, float]] = []  # (verb, resource, seconds)

    def add(self, verb: str, resource: str, code: int, *, namespace: str | None = None,
            name: str | None = None, times: int | None = 1, retry_after: int | None = None,
            message: str | None = None, reason: str | None = None) -> Rule:
        rule = Rule(verb, resource, namespace, name, code, reason or _REASONS.get(code, "Unknown"),
                    message, retry_after, times)
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
            self.delays.clear()

    def delay_for(self, req: Request) -> float:
        """Seconds to hold ``req`` before answering (a loaded or rate-limited server)."""
        with self.lock:
            return sum(d for v, r, d in self.delays if v in ("*", req.verb)
                       and r in ("*", req.resource))

    def log(self, req: Request) -> None:
        with self.lock:
            self.requests.append(req)
            self.lock.notify_all()

    def answered(self, req: Request, code: int) -> None:
        with self.lock:
            req.code = code
            self.lock.notify_all()

    def check(self, req: Request) -> ApiError | None:
        with self.lock:
            for rule in self.rules:
                if rule.matches(req) and (rule.times is None or rule.times > 0):
                    if rule.times is not None:
                        rule.times -= 1
                    return self._error(rule, req)
        return None

    def _error(self, rule: Rule, req: Request) -> ApiError:
        plural, _, sub = req.resource.partition("/")
        base, _, group = plural.partition(".")
        details: dict[str, Any] = {"kind": base}
        if req.name:
            details["name"] = req.name
        if group:
            details["group"] = group
        headers: dict[str, str] = {}
        if rule.code == 403:
            what = f'{plural} "{req.name}"' if req.name else plural
            res = f"{base}/{sub}" if sub else base
            where = f'in the namespace "{req.namespace}"' if req.namespace \
                else "at the cluster scope"
            msg = rule.message or (f'{what} is forbidden: User "{self.user}" cannot {req.verb} '
                                   f'resource "{res}" in API group "{group}" {where}')
        elif rule.code == 429:
            details["retryAfterSeconds"] = rule.retry_after or 1
            headers["Retry-After"] = str(rule.retry_after or 1)
            msg = rule.message or "Too many requests, please try again later."
        elif rule.code == 500:
            msg = rule.message or "Internal error occurred: injected by the fake API server"
            details["causes"] = [{"message": msg}]
        else:
            msg = rule.message or f"injected {rule.code} {rule.reason}"
        if rule.retry_after is not None:
            headers["Retry-After"] = str(rule.retry_after)
            details["retryAfterSeconds"] = rule.retry_after
        return ApiError(rule.code, rule.reason, msg, details, headers)

    def count(self, verb: str | None = None, resource: str | None = None) -> int:
        with self.lock:
            return sum(1 for r in self.requests if verb in (None, r.verb)
                       and resource in (None, r.resource))

    def wait_for(self, verb: str | None = None, resource: str | None = None,
                 after: int = 0, timeout: float = 10.0) -> Request:
        """The first request at index >= ``after`` matching verb/resource."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                for r in self.requests[after:]:
                    if verb in (None, r.verb) and resource in (None, r.resource):
                        return r
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {verb or 'any'} {resource or ''} request to the "
                                         f"fake API server within {timeout}s")
                self.lock.wait(left)
