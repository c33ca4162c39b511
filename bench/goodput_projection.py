"""A projection, not a measurement: ETTR of a 16,384-GPU job under three recovery strategies.

    python bench/goodput_projection.py                 # the defaults below
    python bench/goodput_projection.py --gpus 4096 --checkpoint-interval 900
    python bench/goodput_projection.py --json

    python bench/goodput_projection.py --from bench/results/goodput-random.json \
        --from bench/results/snapshot-1gib.json     # ftagent's costs measured

The failure rate and mix are Llama 3's (466 interruptions in 54 days on 16,384 H100, 419
of them unexpected; about 59 % GPU/HBM, as summarised in the field notes), scaled
linearly with the GPU count. The hardware share is restarted on a new node; the rest
(network, host, software) in place. The per-fault costs of each strategy
(detection, decision, restart in place or on a new node) are **assumptions** printed beside
the result, unless ``--from`` gives the benches' JSON (``bench/goodput.py --json``, its
random schedule; ``bench/snapshot.py --json``): then ftagent's are the measured ones
(``from_measurements``: injection -> training again per fault class) and a strategy
"ftagent + snapshots" is added, its redone work half the snapshot interval the agent would
choose from the measured blocking time (``snapshot_interval``) and its load the measured
resume. ``--set ftagent.detect_hang=45`` overrides any single value.

Model, per strategy, for a job long enough that its start-up does not matter:

* interruptions per second ``r`` = rate per GPU-second x GPUs;
* each one costs detection (a crash or a hang, by ``hang_share``) + decision + restart
  (on a new node for the hardware share of the mix, in place otherwise) + the work since
  the last checkpoint (half an interval on average) + loading the checkpoint;
* checkpoint saves block ``checkpoint_save`` seconds per interval (snapshots: their
  measured blocking time per snapshot interval);
* ETTR = (1 - r x cost) x interval / (interval + save), floored at 0.

Pure functions of the inputs (``project``); the output names every input it used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

DAY = 86400.0


@dataclass(frozen=True)
class Strategy:
    """What one fault costs under a recovery strategy (seconds; assumptions)."""

    name: str
    detect_crash: float  # a process dies -> the recovery starts
    detect_hang: float  # a collective hangs -> declared (a watchdog or NCCL timeout)
    decide: float  # decision and barrier
    restart_in_place: float  # every rank training again on the same nodes
    restart_new_node: float  # a node is replaced (hardware faults)
    note: str = ""
    # in-memory snapshots (issue 34): None: the job's disk checkpoints (the Inputs')
    snapshot_blocking: float | None = None  # seconds a snapshot blocks the step
    snapshot_interval: float | None = None  # seconds between two (None: chosen, below)
    snapshot_load: float = 0.0  # seconds to resume from one (0: inside the restart)
    measured: str = ""  # where the per-fault costs came from ("": assumptions)


@dataclass(frozen=True)
class Inputs:
    gpus: int = 16_384
    # Llama 3 (Dubey et al. 2024, section 3.3.4): 466 interruptions in 54 days, 16,384 GPUs
    interruptions: float = 466.0
    days: float = 54.0
    reference_gpus: int = 16_384
    hardware_share: float = 0.59  # GPU/HBM: the node is replaced
    hang_share: float = 0.10  # of all interruptions, those that hang instead of crashing
    checkpoint_interval: float = 1800.0
    checkpoint_save: float = 10.0  # blocking seconds per save
    checkpoint_load: float = 60.0
    snapshot_budget: float = 0.01  # the share of training time snapshots may block
    strategies: tuple[Strategy, ...] = field(default_factory=lambda: (
        Strategy("ftagent", detect_crash=1.0, detect_hang=60.0, decide=2.0,
                 restart_in_place=20.0, restart_new_node=180.0,
                 note="in-place warm restart; REPLACE reschedules one pod on a spare"),
        Strategy("torchrun --max-restarts", detect_crash=1.0, detect_hang=600.0, decide=0.0,
                 restart_in_place=90.0, restart_new_node=1200.0,
                 note="NCCL timeout for hangs; a dead node needs the job recreated"),
        Strategy("scheduler recreates the job", detect_crash=30.0, detect_hang=600.0,
                 decide=0.0, restart_in_place=600.0, restart_new_node=900.0,
                 note="every pod deleted and scheduled again, images pulled, cold start"),
    ))


@dataclass(frozen=True)
class Result:
    strategy: str
    interruptions_per_day: float
    seconds_per_interruption: float
    lost_to_faults: float  # share of wall time
    lost_to_checkpoints: float  # share of wall time
    ettr: float


def rate_per_second(i: Inputs) -> float:
    return i.interruptions / (i.days * DAY) / i.reference_gpus * i.gpus


def snapshot_interval(i: Inputs, s: Strategy) -> float:
    """Seconds between two snapshots: ``s.snapshot_interval`` if set, else what the agent
    would choose: the interval that loses least to saves and redone work together (Young's
    ``sqrt(2 x blocking / rate)``), never so short that saves block more than
    ``snapshot_budget`` of the training time (``--snapshot-budget``)."""
    if s.snapshot_interval is not None:
        return s.snapshot_interval
    b = s.snapshot_blocking or 0.0
    floor = b / i.snapshot_budget if i.snapshot_budget > 0 else 0.0
    rate = rate_per_second(i)
    young = math.sqrt(2 * b / rate) if rate > 0 and b > 0 else 0.0
    return max(floor, young, 1e-9)


def save_share(i: Inputs, s: Strategy) -> float:
    """The share of wall time saves block: disk checkpoints or snapshots."""
    if s.snapshot_blocking is None:
        return i.checkpoint_save / (i.checkpoint_interval + i.checkpoint_save)
    iv = snapshot_interval(i, s)
    return s.snapshot_blocking / (iv + s.snapshot_blocking)


def per_fault(i: Inputs, s: Strategy) -> float:
    """Mean seconds one interruption costs under ``s``: detection, decision, restart, the
    work since the newest checkpoint or snapshot (half its interval on average) and its
    load."""
    detect = i.hang_share * s.detect_hang + (1 - i.hang_share) * s.detect_crash
    restart = i.hardware_share * s.restart_new_node + (1 - i.hardware_share) * \
        s.restart_in_place
    if s.snapshot_blocking is None:
        redo, load = i.checkpoint_interval / 2, i.checkpoint_load
    else:
        redo, load = snapshot_interval(i, s) / 2, s.snapshot_load
    return detect + s.decide + restart + redo + load


def project(i: Inputs) -> list[Result]:
    if i.days <= 0 or i.reference_gpus <= 0 or i.checkpoint_interval <= 0:
        raise ValueError("days, reference GPUs and the checkpoint interval must be > 0")
    rate = rate_per_second(i)
    out = []
    for s in i.strategies:
        cost = per_fault(i, s)
        ckpt = save_share(i, s)
        faults = min(1.0, rate * cost)
        out.append(Result(s.name, rate * DAY, cost, faults, ckpt * (1 - faults),
                          max(0.0, (1 - faults) * (1 - ckpt))))
    return out


# ---------------------------------------------------------------------- measured costs


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def fault_seconds(runs: list[dict[str, Any]], launcher: str, kind: str) -> float | None:
    """Mean seconds from the injection to training again of ``kind`` faults under
    ``launcher`` in bench/goodput.py's JSON runs (None: none measured)."""
    return _mean([float(f["back"]) for r in runs if r.get("launcher") == launcher
                  for f in r.get("faults", []) if f.get("kind") == kind
                  and f.get("back") is not None])


def from_measurements(i: Inputs, goodput: dict[str, Any] | None,
                      snapshot: dict[str, Any] | None, sources: str = "") -> Inputs:
    """``i`` with ftagent's per-fault costs from the benches' JSON (``bench/goodput.py
    --json``, ``bench/snapshot.py --json``), and a strategy with in-memory snapshots:

    * restart in place = injection -> training again of a crash (detection, decision and
      the restart in one measured figure: detect_crash and decide are 0);
    * detect_hang = a hang's injection -> training again, less the crash's (the hang's
      longer detection);
    * restart on a new node = the Xid's injection -> training again (the lab starts the
      replacement pod at once: a real cluster adds its scheduling and image pull);
    * the snapshot's blocking time and resume time: ftagent's row of the snapshot bench;
      the snapshot interval: chosen (``snapshot_interval``).

    A cost not measured keeps the assumption. Raises ValueError on JSON of another shape."""
    runs = list((goodput or {}).get("runs") or [])
    strategies = list(i.strategies)
    disk = next((s for s in strategies if s.name == "ftagent"), None)
    if disk is None:
        raise ValueError("no ftagent strategy to measure")

    def measured(base: Strategy, launcher: str, name: str, note: str) -> Strategy:
        crash = fault_seconds(runs, launcher, "crash")
        hang = fault_seconds(runs, launcher, "hang")
        xid = fault_seconds(runs, launcher, "xid")
        got = replace(base, name=name, note=note, measured=sources)
        if crash is not None:
            got = replace(got, detect_crash=0.0, decide=0.0, restart_in_place=crash)
            if hang is not None:
                got = replace(got, detect_hang=max(0.0, hang - crash))
        if xid is not None:
            got = replace(got, restart_new_node=xid)
        return got

    launchers = {str(r.get("launcher")) for r in runs}
    out = []
    for s in strategies:
        if s is disk and "ftagent" in launchers:
            s = measured(s, "ftagent", s.name, "measured: bench/goodput.py, disk checkpoints")
        out.append(s)
    if snapshot is not None:
        rows = {str(m.get("method")): m for m in snapshot.get("methods") or []}
        f = rows.get("ftagent")
        if f is None:
            raise ValueError("the snapshot bench's JSON has no ftagent row")
        who = "ftagent-snapshots" if "ftagent-snapshots" in launchers else "ftagent"
        restarts = f"bench/goodput.py ({who})" if who in launchers else \
            "restarts ASSUMED (no bench/goodput.py JSON)"
        snap = measured(disk, who, "ftagent + snapshots",
                        f"measured: {restarts}, bench/snapshot.py "
                        f"({float(snapshot.get('gib', 0)):.2g} GiB a rank)")
        out.insert(1, replace(snap, snapshot_blocking=float(f["blocking"]),
                              snapshot_load=float(f["resume"])))
    return replace(i, strategies=tuple(out))


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            got = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    if not isinstance(got, dict) or got.get("bench") not in ("goodput", "snapshot"):
        raise ValueError(f"{path}: not the JSON of bench/goodput.py or bench/snapshot.py")
    return got


def with_overrides(i: Inputs, sets: list[str]) -> Inputs:
    """``strategy.field=value`` (the strategy's name without its spaces, e.g.
    ``ftagent+snapshots``, or up to its first space) or ``field=value`` for a top-level
    input."""
    for item in sets:
        key, _, value = item.partition("=")
        if not value:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE")
        if "." in key:
            who, attr = key.split(".", 1)
            # the whole name without spaces ("ftagent+snapshots"), else its first word
            found = [s for s in i.strategies if s.name.replace(" ", "") == who] or \
                [s for s in i.strategies if s.name.split(" ")[0] == who]
            if not found or attr not in Strategy.__dataclass_fields__ or attr == "name":
                raise ValueError(f"--set {item!r}: no strategy field {key!r}")
            new = replace(found[0], **{attr: float(value)})  # type: ignore[arg-type]
            i = replace(i, strategies=tuple(new if s is found[0] else s
                                            for s in i.strategies))
        elif key in Inputs.__dataclass_fields__ and key != "strategies":
            kind = type(getattr(i, key))
            i = replace(i, **{key: kind(float(value))})
        else:
            raise ValueError(f"--set {item!r}: no input {key!r}")
    return i


def render(i: Inputs, results: list[Result]) -> str:
    lines = ["PROJECTION (a model, not a measurement): ETTR of one long job", "",
             "inputs:"]
    for k, v in asdict(i).items():
        if k != "strategies":
            lines.append(f"  {k:<22} {v}")
    lines += ["", "per-fault costs (seconds; ASSUMPTIONS unless marked measured):",
              f"  {'strategy':<30} {'crash':>6} {'hang':>6} {'decide':>6} {'in place':>9} "
              f"{'new node':>9}  note"]
    for s in i.strategies:
        lines.append(f"  {s.name:<30} {s.detect_crash:>6.1f} {s.detect_hang:>6.1f} "
                     f"{s.decide:>6.1f} {s.restart_in_place:>9.1f} {s.restart_new_node:>9.1f}"
                     f"  {s.note}")
    for s in i.strategies:
        if s.snapshot_blocking is not None:
            iv = snapshot_interval(i, s)
            lines.append(f"  {s.name}: snapshot blocks {s.snapshot_blocking:.3f} s, resume "
                         f"{s.snapshot_load:.2f} s, interval {iv:.0f} s (saves "
                         f"{100 * save_share(i, s):.2f} % of the time; redone per fault "
                         f"{iv / 2:.0f} s on average)")
        if s.measured:
            lines.append(f"  {s.name}: from {s.measured}")
    lines += ["", "outputs:",
              f"  {'strategy':<30} {'faults/day':>10} {'s/fault':>8} {'to faults':>10} "
              f"{'to ckpt':>8} {'ETTR':>7}"]
    for r in results:
        lines.append(f"  {r.strategy:<30} {r.interruptions_per_day:>10.2f} "
                     f"{r.seconds_per_interruption:>8.0f} {100 * r.lost_to_faults:>9.1f}% "
                     f"{100 * r.lost_to_checkpoints:>7.1f}% {100 * r.ettr:>6.1f}%")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=Inputs.gpus)
    p.add_argument("--checkpoint-interval", type=float, default=Inputs.checkpoint_interval)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="any other input, or STRATEGY.FIELD (e.g. ftagent.detect_hang=45)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--from", dest="sources", action="append", default=[], metavar="JSON",
                   help="the --json output of bench/goodput.py or bench/snapshot.py: "
                   "ftagent's per-fault costs and snapshot figures from it (repeatable)")
    a = p.parse_args(argv)
    try:
        i = replace(Inputs(), gpus=a.gpus, checkpoint_interval=a.checkpoint_interval)
        if a.sources:
            got = {d["bench"]: d for d in map(read_json, a.sources)}
            i = from_measurements(i, got.get("goodput"), got.get("snapshot"),
                                  ", ".join(a.sources))
        i = with_overrides(i, a.set)
        results = project(i)
    except ValueError as e:
        print(f"goodput_projection: {e}", file=sys.stderr)
        return 2
    if a.json:
        out: dict[str, Any] = {"projection": True, "inputs": asdict(i),
                               "results": [asdict(r) for r in results]}
        print(json.dumps(out, indent=2))
    else:
        print(render(i, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
