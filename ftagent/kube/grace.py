"""The agent's ``--stop-timeout`` from the pod's own ``terminationGracePeriodSeconds``.

Why: when a pod goes (deleted, evicted, preempted) the kubelet sends SIGTERM to each
container and SIGKILLs what is left after the pod's grace. The agent forwards SIGTERM to
the trainer and kills the trainer's tree ``--stop-timeout`` later (30 s by default: the
same as the grace's default), and only then records the trainer's exit, tells the arbiter
how the rank ended and closes its events file. With both at 30 s a trainer that uses its
whole grace (a final checkpoint save on SIGTERM) is SIGKILLed together with the agent,
and none of that happens. So the webhook gives the agent the grace less
:data:`STOP_MARGIN`.

The agent cannot learn the grace itself: the downward API exposes no
``spec.terminationGracePeriodSeconds`` (``fieldRef`` supports metadata.name, namespace,
uid, labels, annotations, spec.nodeName, spec.serviceAccountName, status.hostIP(s),
status.podIP(s)), and a grace shortened at delete time (``kubectl delete --grace-period``,
``metadata.deletionGracePeriodSeconds``, a node-pressure eviction's
``--eviction-max-pod-grace-period``) is nowhere in the pod's own view. Admission sees the
pod's spec, so it is decided here, once, and written as ``FTAGENT_STOP_TIMEOUT``.

Pure and total: the pod is hostile input. A grace that is missing or null is Kubernetes'
default (30); a negative one is what the API server makes of it since 1.27 (1); one that
is no whole number (a string, a bool, a float; the API server refuses those, but the
webhook must still answer) is taken as the default with a warning; a huge one is capped
(``MAX_SECONDS``, the agent's own bound). A value the container sets itself
(``FTAGENT_STOP_TIMEOUT``, or ``--stop-timeout`` in a command that already is ``ftagent
run``) is kept; a warning says when it is not below the grace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftagent.config import MAX_SECONDS, SupervisorConfig, shown

ENV = "FTAGENT_STOP_TIMEOUT"
FLAG = "--stop-timeout"
NOTE = "ftagent.io/stop-timeout"  # the annotation saying what the agent got and why
DEFAULT_GRACE = 30  # Kubernetes' default terminationGracePeriodSeconds
DEFAULT_STOP = SupervisorConfig().stop_timeout  # the agent's own default --stop-timeout
# The kubelet never gives a container less than this after SIGTERM (kuberuntime's
# minimumGracePeriodInSeconds), unless the pod is force-deleted.
KUBELET_MIN_GRACE = 2
# What the agent keeps of the grace for itself after the trainer's stop: after the
# trainer's tree is SIGKILLed at --stop-timeout its cleanup is bounded by 1 s (the agent's
# shutdown FLOOR), the loop's last look 0.25 s and the exit guard's 1 s (GUARD_SLACK), so
# about 2.25 s at worst, and milliseconds when nothing is stuck; the rest covers
# the interpreter's exit and a loaded node's scheduling delay. 5 s takes 1/6 of the
# default grace from the trainer: a trainer that needs its full 30 s raises the grace to 35.
STOP_MARGIN = 5
MIN_STOP = 1  # the least the trainer gets: 0 would SIGKILL it at once, with no save at all
MAX_VALUE = 64  # characters of a value set on the container that are parsed
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class StopTimeout:
    """What the webhook does about the agent's stop timeout for one container."""

    value: str | None  # FTAGENT_STOP_TIMEOUT to add; None: the container's own is kept
    note: str  # the ftagent.io/stop-timeout annotation: the value and why
    warnings: tuple[str, ...] = ()


def pod_grace(spec: Mapping[str, Any]) -> tuple[int, str, str]:
    """The pod's ``terminationGracePeriodSeconds`` as Kubernetes will use it, how to name
    it, and a warning ("" when none) for a value that is no whole number. Bounded for any
    input (a 4,000-digit number is named by its cap)."""
    name = "terminationGracePeriodSeconds"
    raw = spec.get(name)
    if raw is None:  # absent or null: the API server defaults it to 30
        return DEFAULT_GRACE, f"{name} {DEFAULT_GRACE} (the default)", ""
    if isinstance(raw, bool) or not isinstance(raw, int):
        what = type(raw).__name__ if not isinstance(raw, str) else f"the string {shown(raw)}"
        return (DEFAULT_GRACE, f"{name} {DEFAULT_GRACE} (the default)",
                f"ftagent: {name} is {what}, not a whole number of seconds: taken as "
                f"{DEFAULT_GRACE}")
    if raw < 0:  # the API server has made a negative grace 1 s since 1.27 (k8s #115606)
        return 1, f"{name} {max(raw, -INT64_MAX - 1)} (1 s, as the API server takes it)", ""
    if raw > INT64_MAX:
        return INT64_MAX, f"{name} {INT64_MAX} (the int64 maximum)", ""
    return raw, f"{name} {raw}", ""


def derived(grace: int) -> int:
    """The agent's --stop-timeout for a pod whose grace is ``grace`` seconds: the grace
    the kubelet gives (at least ``KUBELET_MIN_GRACE``) less ``STOP_MARGIN``, at least
    ``MIN_STOP``, at most the agent's ``MAX_SECONDS``."""
    effective = max(grace, KUBELET_MIN_GRACE)
    return int(max(MIN_STOP, min(effective - STOP_MARGIN, MAX_SECONDS)))


def _seconds(raw: str) -> float | None:
    """``raw`` as the agent reads --stop-timeout (``float``, 0 to MAX_SECONDS), or None."""
    if len(raw) > MAX_VALUE:
        return None
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if math.isfinite(v) and 0 <= v <= MAX_SECONDS else None


def _num(v: float) -> str:
    return str(int(v)) if v.is_integer() else f"{v:g}"


def flag_value(argv: Sequence[str]) -> str | None:
    """The ``--stop-timeout`` in ``ftagent run``'s own arguments (``argv``: what follows
    ``run``; the trainer's command after ``--`` is not the agent's), the last one given."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == FLAG and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(FLAG + "="):
            value = arg[len(FLAG) + 1:]
    return value


def env_value(container: Mapping[str, Any]) -> tuple[bool, str | None]:
    """(whether the container sets FTAGENT_STOP_TIMEOUT, its literal value or None for a
    ``valueFrom``): the last entry of that name, as the kubelet takes it."""
    found, value = False, None
    env = container.get("env")
    for e in env if isinstance(env, list) else ():
        if isinstance(e, dict) and e.get("name") == ENV:
            found = True
            value = None if "valueFrom" in e else str(e.get("value", ""))[:MAX_VALUE + 1]
    return found, value


def stop_timeout(spec: Mapping[str, Any], container: Mapping[str, Any],
                 agent_argv: Sequence[str] | None = None) -> StopTimeout:
    """What the agent in ``container`` (of the pod whose spec is ``spec``) gets as its
    stop timeout. ``agent_argv``: the arguments after ``ftagent run`` when the container's
    command already is the agent (its ``--stop-timeout`` wins over the env, as in the
    agent); None when the webhook wraps the command."""
    grace, given, bad = pod_grace(spec)
    warnings = [bad] if bad else []
    ours = derived(grace)
    if isinstance(container.get("lifecycle"), dict) and \
            container["lifecycle"].get("preStop") is not None:
        given += " (less the trainer's preStop hook's time, which counts against it)"
        warnings.append(f"ftagent: the trainer's preStop hook's time counts against "
                        f"terminationGracePeriodSeconds but not against the agent's "
                        f"{FLAG} ({ours} s): set {ENV} to the grace less the hook's "
                        f"time less {STOP_MARGIN} s")
    flag = flag_value(agent_argv) if agent_argv is not None else None
    has_env, env = env_value(container)
    if flag is not None or has_env or agent_argv is not None:
        source, raw = ((f"{FLAG} {shown(flag)}", flag) if flag is not None else
                       (f"{ENV}={shown(env)}", env) if has_env and env else
                       (f"{ENV}='' (unset: the agent's default {FLAG} "
                        f"{_num(DEFAULT_STOP)})", _num(DEFAULT_STOP)) if env == "" else
                       (f"{ENV} (valueFrom)", None) if has_env else
                       (f"the agent's default {FLAG} {_num(DEFAULT_STOP)}",
                        _num(DEFAULT_STOP)))
        note = f"{source}: set on the container, kept"
        if raw is None:
            return StopTimeout(None, f"{note}; not checked against {given}",
                               tuple(warnings))
        v = _seconds(raw)
        if v is None:
            warnings.append(f"ftagent: {source} is not a number of seconds the agent "
                            f"accepts (0 to {_num(MAX_SECONDS)}): the agent refuses it")
        elif v >= grace:
            warnings.append(f"ftagent: {source} is not below the pod's {given}: the "
                            f"kubelet may SIGKILL the agent before it records the "
                            f"trainer's exit; use at most {ours}")
        return StopTimeout(None, f"{note} ({given})", tuple(warnings))
    note = f"{ours} s: {given} less {STOP_MARGIN} s for the agent's exit"
    if grace - STOP_MARGIN < MIN_STOP:
        note = (f"{ours} s: {given} leaves the trainer almost no grace after SIGTERM "
                f"(the agent keeps {STOP_MARGIN} s of it to record the exit)")
        warnings.append(f"ftagent: {given} leaves the trainer almost no grace: the agent "
                        f"stops it {ours} s after SIGTERM; a final checkpoint save needs "
                        f"terminationGracePeriodSeconds of at least {STOP_MARGIN} s more "
                        f"than it takes")
    return StopTimeout(str(ours), note, tuple(warnings))
