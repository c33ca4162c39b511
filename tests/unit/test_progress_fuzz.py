"""Whatever a trainer prints, the log parser never raises and only reports sane values."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftagent.model import PhaseMarker, Progress
from ftagent.sources.progress import LogProgress

# Fragments of real progress lines, so random lines reach the parsers, not just the filter.
FRAGMENTS = [
    "step", "Step", "step=", "step:", "loss", "loss:", "loss=", "iteration", "Epoch", "Eval begin",
    "Eval samples", "%|", "|", "/", "[", "]", "<", ",", " - ", "{'loss': ", "global_step:",
    "skipped=", "Checkpoint", "checkpoint", "saving checkpoint at iteration",
    "validation loss at iteration", "it/s", "s/it", "ms/step", "Batch [", "Speed:",
    "samples/sec", "tps:", "batch_id:", "epoch:", "\x1b[31m", "\x1b[0m", "nan", "inf", "-",
    "1e309", "E+01", " ", "  ", "\t", "━", "█", "\ufffd", "eval_interval ....", "Validation",
]
text_lines = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.integers(-5, 10**6).map(str),
              st.floats(allow_nan=True, allow_infinity=True).map(repr)),
    max_size=20,
).map("".join)
raw_lines = st.one_of(text_lines.map(lambda s: s.encode("utf-8", "surrogatepass")),
                      st.binary(max_size=300))


def check(obs: list[Progress | PhaseMarker], ts: float) -> None:
    for o in obs:
        assert isinstance(o, (Progress, PhaseMarker))
        assert o.ts == ts
        if isinstance(o, Progress):
            assert isinstance(o.step, int) and o.step >= 0
            for rate in (o.samples_per_second, o.tokens_per_second):
                assert rate is None or 0 < rate < float("inf")
        else:
            assert o.phase in ("checkpoint", "eval")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(raw_lines, max_size=30), st.floats(0, 1e6))
def test_batches_never_raise(lines: list[bytes], ts: float) -> None:
    p = LogProgress()
    check(p.parse_lines(lines, ts), ts)
    assert p.skipped == 0  # short lines: nothing should make a parser fail


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(raw_lines, max_size=30))
def test_single_lines_never_raise(lines: list[bytes]) -> None:
    p = LogProgress([r"(?P<step>-?\d+)\s+(?P<loss>\S+)"])
    out = [o for o in (p.parse(ln, 2.0) for ln in lines) if o is not None]
    check(out, 2.0)


digits = st.text(alphabet="0123456789", min_size=1, max_size=5000)
big_ints = st.one_of(st.integers(2**53 - 2, 2**53 + 2), st.integers(2**63 - 2, 2**64 + 2),
                     st.integers(0, 10**30)).map(str)
hostile_lines = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), digits, big_ints, st.just(" ")), max_size=12,
).map("".join).map(lambda s: s.encode("utf-8", "surrogatepass"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile_lines, max_size=20))
def test_huge_numbers_are_never_steps_and_never_raise(lines: list[bytes]) -> None:
    from ftagent.wire.limits import MAX_STEP

    p = LogProgress(unlimited=True)
    out = p.parse_lines(lines, 3.0)
    check(out, 3.0)
    for o in out:
        if isinstance(o, Progress):
            assert o.step <= MAX_STEP
            assert o.total_steps is None or o.total_steps <= MAX_STEP
            assert o.loss is None or o.loss != o.loss or abs(o.loss) < float("inf")
            assert o.step_seconds is None or o.step_seconds != o.step_seconds or \
                abs(o.step_seconds) < float("inf")
    assert p.skipped == 0  # bounded numbers are no step, not a parser failure
