"""The three PATCH flavours the API server accepts, for the fields ftagent touches.

* RFC 7386 JSON merge patch (``application/merge-patch+json``): maps merge, ``null`` deletes,
  everything else (lists included) replaces.
* RFC 6902 JSON patch (``application/json-patch+json``): done by the ``jsonpatch`` library.
* Strategic merge patch (``application/strategic-merge-patch+json``): a JSON merge patch in
  which some lists merge by a key instead of being replaced. The real server reads the
  strategy from the Go struct tags; here :data:`MERGE_KEYS` lists the tags of the fields
  ftagent and its tests use. Fields not in it replace, as on the real server: notably
  ``spec.taints`` on a Node and ``spec.tolerations`` on a Pod are ``listType=atomic`` (no
  patch strategy), so a client must send the whole list (read, modify, update with the
  resourceVersion, or patch the full list).

Directives handled: ``$patch: delete`` / ``$patch: replace`` inside a merged list element or
map, ``$deleteFromPrimitiveList/<field>``, ``$setElementOrder/<field>`` and ``$retainKeys``
(accepted and dropped; the fake keeps the merged order).
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch


class PatchError(ValueError):
    """A patch the real server would refuse (422 Invalid / 400 BadRequest)."""


# (parent field name, list field name) -> merge key; None as parent matches any parent.
# From k8s.io/api/core/v1/types.go and apimachinery's ObjectMeta struct tags.
MERGE_KEYS: dict[str, str] = {
    "conditions": "type",  # PodStatus, NodeStatus, JobStatus (patchMergeKey:"type")
    "addresses": "type",  # NodeStatus.addresses
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "podIPs": "ip",
    "hostIPs": "ip",
}
# Primitive lists with patchStrategy "merge" (set union); e.g. metadata.finalizers.
SET_LISTS = {"finalizers"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: returns the patched document (``target`` is not modified)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def json_patch(target: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902; a failing ``test`` or a bad path is a :class:`PatchError`."""
    if not isinstance(ops, list):
        raise PatchError("json patch body must be a list of operations")
    try:
        result = jsonpatch.apply_patch(target, ops, in_place=False)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, KeyError,
            IndexError, TypeError) as e:
        raise PatchError(f"the server rejected our request due to an error in our request: "
                         f"{e}") from e
    if not isinstance(result, dict):
        raise PatchError("json patch must leave an object")
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge for the fields in :data:`MERGE_KEYS` / :data:`SET_LISTS`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k in ("$patch", "$retainKeys") or k.startswith("$setElementOrder/"):
            continue
        if k.startswith("$deleteFromPrimitiveList/"):
            field = k.split("/", 1)[1]
            if isinstance(out.get(field), list) and isinstance(v, list):
                out[field] = [x for x in out[field] if x not in v]
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and k in MERGE_KEYS:
            out[k] = _merge_list(out.get(k), v, MERGE_KEYS[k])
        elif isinstance(v, list) and k in SET_LISTS:
            cur = list(out.get(k) or [])
            out[k] = cur + [x for x in v if x not in cur]
        elif isinstance(v, dict):
            merged = strategic_merge_patch(out.get(k), v)
            if merged is None:
                out.pop(k, None)
            else:
                out[k] = merged
        else:
            out[k] = copy.deepcopy(v)
    return out


def _merge_list(current: Any, patch: list[Any], key: str) -> list[Any]:
    if len(patch) == 1 and isinstance(patch[0], dict) and patch[0].get("$patch") == "replace":
        return []
    cur = [copy.deepcopy(x) for x in current] if isinstance(current, list) else []
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"map: {item!r} does not contain declared merge key: {key}")
        idx = next((i for i, c in enumerate(cur) if isinstance(c, dict)
                    and c.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                del cur[idx]
            continue
        if idx is None:
            cur.append({k: v for k, v in item.items() if k != "$patch"})
        else:
            cur[idx] = strategic_merge_patch(cur[idx], item)
    return cur
