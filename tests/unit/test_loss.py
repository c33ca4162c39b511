"""The loss-anomaly detector (detect/loss.py): NaN/inf and spikes, on synthetic and real
losses; the policy's default for LOSS faults (alert only)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence

import pytest

from ftagent.arbiter.policy import FaultReport, PolicyConfig, decide_fault
from ftagent.arbiter.state import JobState, Verdict
from ftagent.config import ConfigError, LossConfig
from ftagent.detect.loss import LossDetector, LossSettings
from ftagent.model import Fault, FaultKind, Progress, Severity, TrainerStart


def feed(d: LossDetector, losses: Sequence[float | None], start: int = 1) -> list[Fault]:
    out: list[Fault] = []
    for i, loss in enumerate(losses):
        out += d.observe(Progress(step=start + i, loss=loss))
    return out


def noisy(n: int, seed: int = 0, level: float = 2.0, noise: float = 0.05) -> list[float]:
    rnd = random.Random(seed)
    return [level * math.exp(-i / 2000) + rnd.gauss(0, noise) for i in range(n)]


def test_nan_loss_is_one_fault_per_episode_with_the_last_losses() -> None:
    d = LossDetector(LossSettings(evidence=5), wall=lambda: 123.0)
    faults = feed(d, [*noisy(30), math.nan, math.nan, math.nan])
    assert len(faults) == 1
    f = faults[0]
    assert f.kind is FaultKind.LOSS and f.severity is Severity.WARNING
    assert f.detected_at == 123.0 and "NaN at step 31" in f.message
    assert f.evidence["reason"] == "nan" and f.evidence["action"] == "alert"
    last = f.evidence["last_losses"]
    assert len(last) == 5 and last[-1] == [31, "nan"]
    json.loads(json.dumps(f.evidence), parse_constant=pytest.fail)  # strict JSON: no NaN
    # finite again, then NaN again: a new episode
    assert feed(d, [1.0, math.inf], start=34)[0].evidence["reason"] == "inf"


def test_a_spike_is_named_and_the_noise_around_it_is_not() -> None:
    losses = noisy(300, seed=1)
    assert feed(LossDetector(), losses) == []  # healthy: no false spike over 300 steps
    losses[200] = 4.0  # ~2x the loss: a divergence
    faults = feed(LossDetector(), losses)
    assert len(faults) == 1 and faults[0].evidence["step"] == 201
    assert faults[0].evidence["score"] > 10 and faults[0].evidence["reason"] == "spike"


def test_one_spike_fault_per_window_and_none_before_the_history_fills() -> None:
    d = LossDetector(LossSettings(window=50, min_history=20))
    assert feed(d, [1.0] * 10 + [100.0]) == []  # 10 losses: too few to judge
    d = LossDetector(LossSettings(window=50, min_history=20))
    base = noisy(40, seed=2, level=1.0, noise=0.01)
    faults = feed(d, base + [5.0, 5.0, 5.0])  # a level shift: one alert, not three
    assert len(faults) == 1


def test_a_constant_loss_does_not_turn_wiggles_into_spikes() -> None:
    d = LossDetector()
    assert feed(d, [0.5] * 50 + [0.502, 0.5, 0.504]) == []  # MAD 0: floored at 1 %
    assert len(feed(d, [1.5], start=54)) == 1  # tripled: a spike


def test_drops_redraws_and_a_new_attempt() -> None:
    d = LossDetector()
    assert feed(d, noisy(50) + [0.01]) == []  # a drop is good news
    assert d.observe(Progress(step=10, loss=math.nan)) == []  # a step back: not new
    d.observe(TrainerStart(pid=1, attempt=1))
    assert len(d.window) == 0 and d.last_step is None


@pytest.mark.parametrize("loss", [1e308, -1e308, 5e-324, None])
def test_huge_and_missing_values_never_raise(loss: float | None) -> None:
    d = LossDetector(LossSettings(min_history=5))
    feed(d, [1.0, -1e308, 1e308, 2.0, 3.0, 1.0])
    d.observe(Progress(step=100, loss=loss))
    d.observe(Progress(step=101, loss="oops"))  # type: ignore[arg-type]


def test_real_losses_of_a_small_model_diverging() -> None:
    """A real torch regression: trains cleanly (no fault), then the learning rate is
    raised until it diverges: the spike is flagged before the loss becomes inf/NaN."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    d = LossDetector(LossSettings(window=50))
    faults: list[Fault] = []
    for step in range(1, 400):
        if step == 300:
            for g in opt.param_groups:
                g["lr"] = 5.0
        x = torch.randn(32, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        got = d.observe(Progress(step=step, loss=loss.item()))
        assert step >= 300 or not got, f"false alarm at step {step}: {got}"
        faults += got
    assert faults and faults[0].evidence["reason"] == "spike"
    assert faults[0].evidence["step"] in range(300, 320)


def test_settings_from_flags_and_bad_flags() -> None:
    s = LossSettings.of(LossConfig(loss_action="restart", loss_spike_window=10,
                                   loss_spike_threshold=3.0))
    assert (s.window, s.threshold, s.min_history, s.action) == (10, 3.0, 10, "restart")
    from ftagent.cmd.run import parse

    with pytest.raises(ConfigError):
        parse(["--loss-spike-threshold", "nan", "--", "true"], {})
    cfg = parse(["--", "true"], {"FTAGENT_LOSS_ACTION": "off"})
    assert cfg.loss.loss_action == "off"


def _decide(fault: Fault) -> Verdict:
    job = JobState(job="j", namespace="default")
    return decide_fault(job, FaultReport(fault, rank=0, generation=0), 0.0,
                        PolicyConfig())[0].verdict


def test_policy_alerts_on_loss_faults_unless_restart_was_asked() -> None:
    d = LossDetector()
    alert = feed(d, [1.0] * 30 + [math.nan])[0]
    assert _decide(alert) is Verdict.ALERT_ONLY
    d = LossDetector(LossSettings(action="restart"))
    restart = feed(d, [1.0] * 30 + [math.nan])[0]
    assert restart.severity is Severity.ERROR
    assert _decide(restart) is Verdict.RESTART


def test_cached_window_statistics_decide_the_same_spikes_as_fresh_ones() -> None:
    """The median and scale are recomputed every few steps; a candidate is re-scored on
    fresh ones: the spikes found are those a fresh computation on every step finds."""
    import statistics as st

    from ftagent.detect.loss import MAD_TO_SIGMA, SCALE_FLOOR

    rng = random.Random(7)
    losses = [5.0 * 0.999 ** i + rng.gauss(0, 0.02) for i in range(3000)]
    for i in rng.sample(range(200, 3000), 25):
        losses[i] *= rng.choice((1.3, 2.0, 6.0))  # some spikes, some merely bumps
    det = LossDetector(LossSettings(window=100, threshold=10.0))
    found = {f.evidence["step"] for i, x in enumerate(losses)
             for f in det.observe(Progress(i, loss=x))}
    window: list[float] = []
    expected, until = set(), -1
    for i, x in enumerate(losses):
        if len(window) >= max(det.s.min_history, 2):
            med = st.median(window)
            scale = max(MAD_TO_SIGMA * st.median([abs(v - med) for v in window]),
                        SCALE_FLOOR * abs(med), 1e-12)
            if (x - med) / scale > 10.0 and i >= until:
                expected.add(i)
                until = i + 100
        window = (window + [x])[-100:]
    assert found == expected and len(found) >= 5


def test_a_spike_in_a_step_folded_into_a_later_one_is_still_judged() -> None:
    """Steps read in one batch reach the detectors as their last step, with the earlier
    steps' losses folded in (run_cli.latest_progress): a spike among them is found at its
    own step, and the same losses give the same faults as one observation per step."""
    from ftagent.cmd.run import latest_progress

    losses = noisy(300, seed=1)
    losses[199] = 4.0  # step 200: the middle of the read of steps 199-201
    batched: list[Fault] = []
    d = LossDetector()
    for start in range(0, 300, 3):  # three steps per read, as the output pump coalesces
        batch = [Progress(step=i + 1, loss=losses[i], ts=float(start))
                 for i in range(start, min(start + 3, 300))]
        (obs,) = latest_progress(list(batch))
        assert isinstance(obs, Progress) and len(obs.folded_losses) == len(batch) - 1
        batched += d.observe(obs)
    one_by_one = feed(LossDetector(), losses)
    assert [f.evidence["step"] for f in batched] == [f.evidence["step"] for f in one_by_one]
    assert [f.evidence["step"] for f in batched] == [200]
