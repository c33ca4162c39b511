"""The pod-level tiers of the recovery ladder at the Kubernetes edge: the container
restart rules the webhook adds (KEP-5307/5532), and what one rank's pod and node have
(``ladder.Features``) read from the watches' objects. Pure: objects in, values out.

* ``add_rules(container, pod_policy)``: the trainer container (where the agent is the
  entrypoint) gets two rules -- exit ``EXIT_RESTART_CONTAINER`` -> ``Restart``, exit
  ``EXIT_RESET_POD`` -> ``RestartAllContainers`` (only the first where the cluster is
  1.35: its API server refuses the second action with that gate off) -- after any rules
  of its own (the first match wins, theirs stay first), and, as the API server requires
  of a container with rules, its own ``restartPolicy``: the pod's (``Always`` when
  unset), so that every other exit behaves as before. A cluster without the gates drops
  the fields at admission (disabled-gate fields are cleared): the pod is as without them.
* ``features_of(pod, node)``: the actions those rules give ftagent's exit codes *in the
  pod as stored* (the API server kept them: its gates are on), the node's declared
  features (``status.declaredFeatures``, NodeDeclaredFeatures; None when it says none)
  and its kubelet's version (``status.nodeInfo.kubeletVersion``). Odd or missing fields
  read as "not known", so the ladder falls back to the next tier.
* ``Streaks``: how many RESTARTs in a row (consecutive generations) blamed one rank --
  the ladder's escalation past a process restart that did not clear the fault.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ftagent.arbiter.ladder import Features, parse_version
from ftagent.kube.cluster_faults import get
from ftagent.model import EXIT_RESET_POD, EXIT_RESTART_CONTAINER

RULES = ((EXIT_RESTART_CONTAINER, "Restart"), (EXIT_RESET_POD, "RestartAllContainers"))
MAX_RULES = 20  # the API server's limit on a container's restartPolicyRules
MAX_DECLARED = 256  # features read from one node (the list is the kubelet's, sorted)
POD_POLICIES = ("Always", "OnFailure", "Never")
AGENT_ENV = "FTAGENT_JOB"  # set by the webhook on the container it wraps
KEPT_JOBS = 10_000


def add_rules(container: dict[str, Any], pod_policy: Any, reset_pod: bool = True) -> str:
    """Give ``container`` ftagent's restart rules (without the RestartAllContainers one
    unless ``reset_pod``: an API server without that gate refuses the action, 1.35);
    '' when added, else why not (its rules already full, or a restart policy the API
    would refuse next to them)."""
    wanted = RULES if reset_pod else RULES[:1]
    rules = container.get("restartPolicyRules")
    rules = list(rules) if isinstance(rules, list) else []
    mine = [c for c, _ in wanted if any(isinstance(r, Mapping) and _codes(r) == [c]
                                        for r in rules)]
    if len(mine) == len(wanted):
        return ""  # a reinvocation, or the user's own template carries them
    if len(rules) + len(wanted) > MAX_RULES:
        return f"the container has {len(rules)} restart rules (at most {MAX_RULES})"
    own = container.get("restartPolicy")
    if own is None:
        policy = pod_policy if pod_policy in POD_POLICIES else "Always"
        container["restartPolicy"] = policy
    elif own not in POD_POLICIES:
        return f"the container's restartPolicy {str(own)[:20]!r} is not one rules go with"
    for code, action in wanted:
        if code not in mine:
            rules.append({"action": action,
                          "exitCodes": {"operator": "In", "values": [code]}})
    container["restartPolicyRules"] = rules
    return ""


def _codes(rule: Mapping[str, Any]) -> list[int] | None:
    ec = rule.get("exitCodes")
    if not isinstance(ec, Mapping) or ec.get("operator") != "In":
        return None
    vals = ec.get("values")
    return list(vals) if isinstance(vals, list) else None


def rule_action(container: Any, code: int) -> str:
    """The action of ``container``'s first restart rule matching exit ``code`` ('' for
    none), evaluated in order as the kubelet does (In / NotIn)."""
    rules = get(container, "restartPolicyRules")
    if not isinstance(rules, list):
        return ""
    for r in rules[:MAX_RULES]:
        if not isinstance(r, Mapping):
            continue
        ec = r.get("exitCodes")
        if not isinstance(ec, Mapping):
            continue
        vals = ec.get("values")
        inside = isinstance(vals, list) and code in vals[:255]
        op = ec.get("operator")
        if (op == "In" and inside) or (op == "NotIn" and not inside):
            action = r.get("action")
            return action if isinstance(action, str) else ""
    return ""


def _agent_containers(pod: Any) -> list[Any]:
    cs = get(pod, "spec", "containers")
    if not isinstance(cs, list):
        return []
    def wraps(c: Mapping[str, Any]) -> bool:
        env = c.get("env")
        return isinstance(env, list) and any(
            isinstance(e, Mapping) and e.get("name") == AGENT_ENV for e in env)

    wrapped = [c for c in cs if isinstance(c, Mapping) and wraps(c)]
    return wrapped or [c for c in cs if isinstance(c, Mapping)]


def pod_rules(pod: Any) -> frozenset[str]:
    """The actions the pod's rules give ftagent's exit codes on the agent's container(s):
    an action counts only when every such container's first matching rule is it."""
    got: set[str] = set()
    containers = _agent_containers(pod)
    for code, action in RULES:
        if containers and all(rule_action(c, code) == action for c in containers):
            got.add(action)
    return frozenset(got)


def declared(node: Any) -> frozenset[str] | None:
    feats = get(node, "status", "declaredFeatures")
    if not isinstance(feats, list):
        return None
    return frozenset(f for f in feats[:MAX_DECLARED] if isinstance(f, str) and len(f) <= 128)


def features_of(pod: Any, node: Any, *, spare: bool = False, repeats: int = 0) -> Features:
    """What the rank running in ``pod`` on ``node`` has (either None: not known)."""
    version = get(node, "status", "nodeInfo", "kubeletVersion")
    return Features(version=parse_version(version) if isinstance(version, str) else None,
                    declared=declared(node) if node is not None else None,
                    rules=pod_rules(pod) if pod is not None else None,
                    spare=spare, repeats=repeats)


class Streaks:
    """Per job, the rank the last RESTART blamed, at which generation, and how many in a
    row (each at the generation after the one before). Bounded by KEPT_JOBS."""

    def __init__(self) -> None:
        self._last: OrderedDict[tuple[str, str], tuple[int, int, int]] = OrderedDict()

    def note(self, key: tuple[str, str], rank: int | None, generation: int,
             restart: bool) -> None:
        """A decision of the job that moved it to ``generation``: a RESTART blaming
        ``rank`` extends or starts its streak; anything else that restarts ends it."""
        if not restart or rank is None or rank < 0:
            self._last.pop(key, None)
            return
        prev = self._last.get(key)
        n = prev[2] + 1 if prev and prev[0] == rank and prev[1] == generation - 1 else 1
        self._last[key] = (rank, generation, n)
        self._last.move_to_end(key)
        while len(self._last) > KEPT_JOBS:
            self._last.popitem(last=False)

    def repeats(self, key: tuple[str, str], rank: int, generation: int) -> int:
        """Restarts in a row blamed on ``rank`` up to the one that began ``generation``."""
        prev = self._last.get(key)
        return prev[2] if prev and prev[0] == rank and prev[1] == generation else 0
