"""One way to build the ``kubernetes`` ApiClient every ftagent part uses, and read its errors.

Where the API server is comes from, in order: an explicit URL (``--kube-api URL``, with a
bearer token or token file and a CA file), the pod's service account (in-cluster), or a
kubeconfig (``--kubeconfig PATH``, ``$KUBECONFIG``, ``~/.kube/config``). Nothing is
global: the client is returned, never installed as the library's default, so two clients
(two clusters, a test's fake and a real one) can live in one process.

urllib3 would otherwise sleep ``Retry-After`` inside a GET and retry it by itself: a
thread blocked there cannot be stopped and its caller cannot see the 429. The client is
built with that off; callers honour ``Retry-After`` themselves (:func:`retry_after`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

IN_CLUSTER_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class KubeConfigError(RuntimeError):
    """No usable way to reach the API server; the message says what to set."""


def api_client(url: str | None = None, *, token: str | None = None,
               token_file: str | None = None, ca_file: str | None = None,
               insecure: bool = False, kubeconfig: str | None = None,
               context: str | None = None, in_cluster: bool | None = None,
               connect_retries: int = 3) -> Any:
    """A ``kubernetes.client.ApiClient``.

    ``url``: the API server (``https://10.0.0.1:6443``); with it ``token`` or ``token_file``
    (re-read when the file changes, as projected service-account tokens rotate) and
    ``ca_file`` (or ``insecure=True``). Without it: in-cluster config when
    ``in_cluster`` is True or None and ``KUBERNETES_SERVICE_HOST`` is set, else the
    kubeconfig (``kubeconfig`` path, ``context``). Raises :class:`KubeConfigError`.
    """
    try:
        from kubernetes import client
        from urllib3.util.retry import Retry
    except ImportError as e:  # pragma: no cover - the [kube] extra is not installed
        raise KubeConfigError("the kubernetes client is not installed: "
                              "pip install 'ftagent[kube]'") from e
    cfg = client.Configuration()
    if url:
        cfg.host = url.rstrip("/")
        if token and token_file:
            raise KubeConfigError("give a token or a token file, not both")
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        elif token_file:
            _token_from_file(cfg, token_file)
        if ca_file:
            if not Path(ca_file).is_file():
                raise KubeConfigError(f"CA file {ca_file} does not exist")
            cfg.ssl_ca_cert = ca_file
        cfg.verify_ssl = not insecure
    elif in_cluster is True or (in_cluster is None and os.environ.get("KUBERNETES_SERVICE_HOST")):
        from kubernetes import config  # (the config loaders only where they are used)

        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException as e:
            raise KubeConfigError(f"in-cluster config unusable ({e}); give --kube-api URL "
                                  "or --kubeconfig PATH") from e
    else:
        from kubernetes import config

        try:
            config.load_kube_config(config_file=kubeconfig, context=context,
                                    client_configuration=cfg)
        except (config.ConfigException, OSError, TypeError) as e:
            raise KubeConfigError(f"no usable kubeconfig ({e}); give --kube-api URL or "
                                  "--kubeconfig PATH, or run in a pod with a service "
                                  "account") from e
    cfg.retries = Retry(total=connect_retries, connect=connect_retries, read=0,
                        status=0, respect_retry_after_header=False, raise_on_status=False)
    return client.ApiClient(cfg)


def _token_from_file(cfg: Any, path: str) -> None:
    if not Path(path).is_file():
        raise KubeConfigError(f"token file {path} does not exist")
    state: dict[str, Any] = {"mtime": None}

    def refresh(c: Any) -> None:
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return  # keep the last token: a rotation in progress must not fail requests
        if mtime != state["mtime"]:
            state["mtime"] = mtime
            c.api_key = {"authorization": Path(path).read_text().strip()}
            c.api_key_prefix = {"authorization": "Bearer"}

    refresh(cfg)
    cfg.refresh_api_key_hook = refresh


def send(api: Any, method: str, path: str, body: Any = None, *,
         query: list[tuple[str, Any]] | None = None, content_type: str = "application/json",
         timeout: Any = None) -> Any:
    """One request to ``path`` through the ``kubernetes`` ApiClient ``api``, as the
    generated methods make it with ``_preload_content=False``: the same URL, query, auth,
    JSON body, the urllib3 response returned unread, and ApiException (404, 409, 5xx...)
    raised for an answer that is not 2xx. Without importing a generated API class:
    ``CoreV1Api`` imports hundreds of pydantic models, half a second of CPU that an
    arbiter would otherwise spend at its first Event, in the middle of its first restart's
    fan-out (or before it listens)."""
    from kubernetes.client.exceptions import ApiException

    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    request = api.param_serialize(method=method, resource_path=path, query_params=query or [],
                                  header_params=headers, body=body,
                                  auth_settings=["BearerToken"])
    resp = api.call_api(*request, _request_timeout=timeout)
    if not 200 <= resp.status <= 299:
        resp.read()
        raise ApiException.from_response(http_resp=resp, body=None, data=None)
    return resp.response


def path_of(*parts: str) -> str:
    """``/api/v1`` + each part quoted as one path segment (a name never adds a level)."""
    from urllib.parse import quote

    return "/api/v1/" + "/".join(quote(p, safe="") for p in parts)


def status_of(exc: Any) -> dict[str, Any]:
    """The ``Status`` object an ``ApiException`` carries ({} if the body is not one)."""
    body = getattr(exc, "body", None)
    if not body:
        return {}
    try:
        out = json.loads(body[:65536] if isinstance(body, (str, bytes)) else body)
    except (TypeError, ValueError):
        return {}
    return out if isinstance(out, dict) and out.get("kind") == "Status" else {}


def retry_after(exc: Any, cap: float = 300.0) -> float | None:
    """Seconds a 429/503 asks to wait (the ``Retry-After`` header, else
    ``details.retryAfterSeconds``), capped; None when it asks for nothing."""
    headers = getattr(exc, "headers", None) or {}
    raw: Any = None
    try:
        raw = headers.get("Retry-After") or headers.get("retry-after")
    except AttributeError:
        raw = None
    if raw is None:
        raw = (status_of(exc).get("details") or {}).get("retryAfterSeconds")
    secs: float | None
    try:
        secs = float(raw)
    except (TypeError, ValueError):
        secs = _http_date_in(raw)
    if secs is None:
        return None
    if secs != secs or secs < 0:  # NaN or negative
        return None
    return min(secs, cap)


def _http_date_in(raw: Any) -> float | None:
    """Seconds until an HTTP-date ``Retry-After`` (RFC 9110 allows either form), by the
    standard library's RFC 5322 date parser; None when ``raw`` is not one."""
    import email.utils
    import time

    if not isinstance(raw, str) or len(raw) > 64:
        return None
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())


def forbidden_message(exc: Any) -> str:
    """The API server's own words for a 403 (they name the user, verb, resource, group
    and namespace: the missing RBAC rule), bounded."""
    msg = str(status_of(exc).get("message") or getattr(exc, "reason", "") or "forbidden")
    return msg[:500]
