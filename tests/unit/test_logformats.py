"""Trainer log lines → Progress / PhaseMarker, on real-looking samples of each framework."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from ftagent.config import ConfigError
from ftagent.model import PhaseMarker, Progress, Resumed
from ftagent.sources import progress as progress_mod
from ftagent.sources.progress import MAX_LINE, UNLOCK_AFTER, LogProgress

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def lines_of(name: str) -> list[bytes]:
    """Split like the agent's tee: on \\r and \\n (tqdm redraws become lines)."""
    return [ln for ln in re.split(rb"\r\n|\r|\n", (LOGS / name).read_bytes()) if ln]


def compact(obs: list[Progress | PhaseMarker | Resumed]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for o in obs:
        if isinstance(o, Resumed):
            out.append(("R", o.step, o.source))
        elif isinstance(o, Progress):
            loss = None if o.loss is None else ("nan" if math.isnan(o.loss) else round(o.loss, 4))
            out.append(("P", o.step, loss, o.source))
        else:
            out.append(("B" if o.begin else "E", o.phase))
    return out


EXPECTED: dict[str, list[tuple[object, ...]]] = {
    "megatron.log": [
        ("P", 1, 10.4673, "megatron"), ("P", 2, 10.4402, "megatron"),
        ("P", 3, 10.4189, "megatron"),
        ("B", "eval"),  # iteration 4 is a multiple of eval_interval 4 (from the arg dump)
        ("E", "eval"), ("B", "checkpoint"), ("E", "checkpoint"),
        ("P", 5, "nan", "megatron"),
    ],
    "nemo.log": [("P", 0, 11.03, "nemo"), ("P", 1, 11.03, "nemo"), ("P", 28, 2.778, "nemo")],
    "deepspeed.log": [
        ("P", 10, None, "deepspeed"), ("P", 10, None, "deepspeed"),
        ("P", 20, None, "deepspeed"), ("P", 20, None, "deepspeed"),
        ("B", "checkpoint"), ("E", "checkpoint"),
    ],
    "torchtitan.log": [
        ("P", 1, 12.2366, "torchtitan"), ("P", 10, 9.4821, "torchtitan"),
        ("B", "checkpoint"), ("E", "checkpoint"), ("P", 640, 6.2116, "torchtitan"),
    ],
    "hf.log": [
        ("P", 1, None, "tqdm"), ("P", 2, None, "tqdm"), ("P", 3, None, "tqdm"),
        ("P", 3, 2.3012, "hf"), ("P", 4, None, "tqdm"), ("P", 5, None, "tqdm"),
        ("B", "eval"), ("E", "eval"), ("P", 7, None, "tqdm"), ("P", 7, 1.1641, "hf"),
    ],
    "lightning.log": [
        ("P", 1, 0.912, "lightning"), ("P", 45, 0.512, "lightning"),
        ("P", 100, 0.401, "lightning"), ("B", "eval"), ("E", "eval"),
        ("P", 103, 0.39, "lightning"),
    ],
    "keras.log": [
        ("P", 120, 0.31, "keras"), ("P", 500, 0.2876, "keras"),
        ("P", 620, 0.19, "keras"), ("P", 750, 0.185, "keras"),
    ],
    "paddle.log": [
        ("P", 10, 0.5512, "paddle"), ("P", 938, 0.0362, "paddle"),
        ("B", "eval"), ("E", "eval"),  # the eval step line in between is not a training step
        ("P", 948, 0.031, "paddle"),
        ("P", 10, 2.3, "paddle"), ("P", 11, 1.9, "paddle"),  # fleet: epoch 1 continues the count
    ],
    "mxnet.log": [("P", 100, 0.301, "mxnet"), ("P", 201, None, "mxnet")],
    "generic.log": [
        ("P", 1, 1.2031, "generic"), ("P", 2, 0.9213, "generic"),
        ("B", "checkpoint"), ("E", "checkpoint"),
        ("P", 3, 0.8123, "generic"), ("P", 4, 0.7001, "generic"),
        # "step 5: waiting for data ..." and "step 5: (fault) hanging" are not progress
    ],
    "noise.log": [],
    # "loaded checkpoint ... iteration N" of each trainer (issue 24): the step it resumed
    # after. Lightning's "last.ckpt" names no step (unknown, not a guess); a step of 26
    # digits is no step; "loading ... at iteration" and "Restoring states" are before the
    # load, not a resume.
    "resume.log": [
        ("R", 1200, "megatron"), ("R", 800, "deepspeed"), ("R", 500, "hf"),
        ("R", 640, "torchtitan"), ("R", 1250, "lightning"), ("R", 20, "generic"),
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_batch(name: str) -> None:
    assert compact(LogProgress().parse_lines(lines_of(name), 5.0)) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_line_by_line_matches_batch(name: str) -> None:
    p = LogProgress()
    obs = [o for o in (p.parse(ln, 5.0) for ln in lines_of(name)) if o is not None]
    assert compact(obs) == EXPECTED[name]
    assert all(o.ts == 5.0 for o in obs)


def test_fixture_lines_one_batch_each() -> None:
    """The tee may hand lines over one at a time or in any grouping."""
    p = LogProgress()
    obs = [o for ln in lines_of("megatron.log") for o in p.parse_lines([ln], 1.0)]
    assert compact(obs) == EXPECTED["megatron.log"]


def test_throughput_fields() -> None:
    p = LogProgress()
    meg = p.parse_lines(lines_of("megatron.log"), 0.0)[1]
    assert isinstance(meg, Progress)
    assert meg.step_seconds == pytest.approx(12.9361)
    assert meg.samples_per_second == pytest.approx(128 / 12.9361)
    titan = LogProgress().parse_lines(lines_of("torchtitan.log"), 0.0)[0]
    assert isinstance(titan, Progress) and titan.tokens_per_second == 1044.0
    gen = LogProgress().parse_lines(lines_of("generic.log"), 0.0)
    assert isinstance(gen[0], Progress) and gen[0].samples_per_second == 802.1
    assert isinstance(gen[4], Progress) and gen[4].tokens_per_second == 12345.0
    ds = LogProgress().parse_lines(lines_of("deepspeed.log"), 0.0)[1]
    assert isinstance(ds, Progress) and ds.samples_per_second == 24.91
    nemo = LogProgress().parse_lines(lines_of("nemo.log"), 0.0)[2]
    assert isinstance(nemo, Progress) and nemo.step_seconds == 0.189
    assert nemo.samples_per_second == pytest.approx(32 / 0.189)


def test_megatron_samples_from_consumed_when_no_batch_size() -> None:
    """examples/train.py's megatron style has no "global batch size" column."""
    p = LogProgress()
    line = (b"[rank0]  iteration %8d/     100 | consumed samples: %d | "
            b"elapsed time per iteration (ms): 50.0 | lm loss: 1.0E+00 |")
    first = p.parse(line % (1, 32), 0.0)
    second = p.parse(line % (2, 64), 0.1)
    assert isinstance(first, Progress) and first.samples_per_second is None
    assert isinstance(second, Progress) and second.samples_per_second == pytest.approx(640.0)


def test_hf_dict_before_any_bar_is_ignored() -> None:
    assert LogProgress().parse(b"{'loss': 1.1641, 'epoch': 0.5}", 0.0) is None


def test_keras_without_epoch_line_counts_from_one() -> None:
    o = LogProgress().parse(b"30/100 [=====>......] - ETA: 1s - loss: 0.5", 0.0)
    assert isinstance(o, Progress) and o.step == 30


@pytest.mark.parametrize("line", [
    b"[rank0] step 5: waiting for data ...",
    b"Total optimization steps = 1000",
    b"Loading checkpoint shards: 100%|##########| 2/2 [00:05<00:00,  2.61s/it]",
    b"  0%|          | 0/150 [00:00<?, ?it/s]",
    b"Sanity Checking DataLoader 0: 100%|##########| 2/2 [00:00<00:00, 80.1it/s]",
    b"Epoch 3/10",
    b"loss scale: 65536.0 | iteration",
    b"",
])
def test_not_progress(line: bytes) -> None:
    assert LogProgress().parse(line, 0.0) is None


@pytest.mark.parametrize("line", [
    b"x" * (10 * 1024 * 1024) + b" step=1 loss=0.5",  # 10 MB
    bytes(range(256)) * 64,  # binary
    b"\xff\xfe step=\xff1 loss=\xc3\x28",  # invalid UTF-8
    b"\x1b[31m\x1b[0m\x1b]0;title\x07\x1b[2J step",  # only ANSI
    b"step=99999999999999999999999999999999999999999 loss=1e999999",  # huge numbers
    b"iteration 1/ 2 |" + b"|:" * 4000,
    b"  5%|" + b"\xe2\x96\x88" * 5000 + b"| 1/2 [",
])
def test_hostile_lines_never_raise(line: bytes) -> None:
    p = LogProgress()
    p.parse(line, 0.0)
    p.parse_lines([line, b"step=1 loss=0.5"], 0.0)


def test_long_line_is_skipped_and_counted() -> None:
    p = LogProgress()
    assert p.parse_lines([b"step=1 loss=0.5 " + b"x" * MAX_LINE], 0.0) == []
    assert p.skipped == 1


def test_ansi_is_stripped_before_parsing() -> None:
    o = LogProgress().parse(b"\x1b[31mstep=\x1b[0m7 \x1b[1mloss=\x1b[0m0.25", 0.0)
    assert isinstance(o, Progress) and (o.step, o.loss) == (7, 0.25)


def test_user_regex_is_tried_first() -> None:
    p = LogProgress([r"it (?P<step>\d+) l=(?P<loss>[\d.]+) sps=(?P<samples_per_second>[\d.]+)"])
    o = p.parse(b"it 12 l=0.5 sps=100.5 step=99 loss=9", 1.0)
    assert o == Progress(step=12, loss=0.5, samples_per_second=100.5, source="user", ts=1.0)
    assert p.parse_lines([b"nothing", b"it 13 l=0.4 sps=1"], 2.0)[0].step == 13  # type: ignore[union-attr]
    # built-in formats still work next to it
    assert isinstance(p.parse(b"saving checkpoint at iteration 5 to /x", 3.0), PhaseMarker)


def test_user_regex_unicode_falls_back_to_text() -> None:
    p = LogProgress([r"шаг (?P<step>\d+)"])
    o = p.parse("шаг 5 готово".encode(), 0.0)
    assert isinstance(o, Progress) and o.step == 5


def test_user_regex_needs_step_group() -> None:
    with pytest.raises(ConfigError, match="step"):
        LogProgress([r"loss=(?P<loss>\d+)"])


def test_needles_narrow_to_the_format_then_widen_after_silence() -> None:
    p = LogProgress()
    for i in range(1, 4):
        p.parse(b"[rank0] step=%d loss=0.5" % i, float(i))
    assert p.families == {"generic"}
    bar = b" 10%|#         | 10/100 [00:01<00:09, 9.0it/s]"
    # locked on the generic family: a tqdm bar right after a step is not even looked at
    assert p.parse(bar, 3.5) is None
    # phase markers are always looked for
    assert isinstance(p.parse(b"saving checkpoint at iteration 3 to /c", 3.6), PhaseMarker)
    # after UNLOCK_AFTER seconds without a step every needle is back
    assert isinstance(p.parse(bar, 3.0 + UNLOCK_AFTER + 0.1), Progress)
    assert p.families == {"generic", "tqdm"}


def test_reset_forgets_epochs_and_format() -> None:
    p = LogProgress()
    p.parse(b"Epoch 3/10", 0.0)
    o = p.parse(b"10/100 [==>...] - ETA: 1s - loss: 0.5", 0.0)
    assert isinstance(o, Progress) and o.step == 210
    p.reset()
    o = p.parse(b"10/100 [==>...] - ETA: 1s - loss: 0.5", 0.0)
    assert isinstance(o, Progress) and o.step == 10
    assert p.families == {"epoch_bar"}


def test_parser_error_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise RuntimeError("bug")

    fmt = progress_mod._DISPATCH[-1][0]
    monkeypatch.setattr(progress_mod, "_DISPATCH",
                        ((type(fmt)("boom", "boom", ("tep",), boom), ("tep",)),))
    p = LogProgress()
    assert p.parse(b"step=1 loss=2", 0.0) is None
    assert p.parse_lines([b"step=1 loss=2"], 0.0) == []
    assert p.skipped == 2


def test_total_steps_where_the_format_prints_the_run_length() -> None:
    from ftagent.sources.progress import LogProgress

    p = LogProgress()
    mg = p.parse(b" [2025-08-01 07:19:50] iteration        2/    5000 | consumed samples: 256 |"
                 b" elapsed time per iteration (ms): 12936.1 | lm loss: 1.044022E+01 |", 1.0)
    assert isinstance(mg, Progress) and mg.total_steps == 5000
    p = LogProgress()
    g = p.parse(b"[rank0] step=12/120 loss=0.4213 samples_per_second=1234.5", 1.0)
    assert isinstance(g, Progress) and g.step == 12 and g.total_steps == 120
    g = p.parse(b"step=13 loss=0.4", 2.0)
    assert isinstance(g, Progress) and g.total_steps is None


# --------------------------------------------------------------------------- hostile numbers

def test_counts_beyond_max_digits_or_max_step_are_no_step_and_no_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    from ftagent.wire.limits import MAX_STEP

    huge = "9" * 4400  # int() refuses over 4,300 digits
    lines = [f"step={huge} loss=0.5", f"step={2**63 + 5} loss=0.5", f"step={MAX_STEP + 1} loss=1",
             f"iteration {huge}/{huge} | lm loss: 1.0 |", f"step: {2**64} loss: 1.0",
             f" 50%|#####     | {huge}/{huge} [00:01<00:01, 1.0it/s]",
             f"Epoch {huge}/10", f"{huge}/500 [==>...] - loss: 0.3",
             f"epoch: 1, batch_id: {huge}, loss: 2.3", f"Epoch[1] Batch [{huge}]\tSpeed: 1 "
             "samples/sec", f"step={huge}, skipped=0", f"global_step={huge}, "
             "RunningAvgSamplesPerSec=1.0", f"iteration 5/10 | global_step: {huge} | loss: 1 |",
             "iteration 5/10 | global_step: 1e300 | loss: 1 |",
             "iteration 5/10 | consumed samples: 1e300 | lm loss: 1 |"]
    p = LogProgress()
    with caplog.at_level("DEBUG", logger="ftagent.progress"):
        out = p.parse_lines([ln.encode() for ln in lines], 1.0)
    assert all(o.step <= MAX_STEP for o in out if isinstance(o, Progress))
    assert p.skipped == 0 and "Traceback" not in caplog.text and not caplog.records
    ok = p.parse(f"step={MAX_STEP} loss=0.5".encode(), 2.0)
    assert isinstance(ok, Progress) and ok.step == MAX_STEP


def test_user_pattern_bounds_its_step_too() -> None:
    p = LogProgress([r"it (?P<step>\S+) l (?P<loss>\S+)"])
    for bad in ("9" * 4400, "1e300", "inf", "nan", "-3", str(2**53)):
        assert p.parse(f"it {bad} l 0.5".encode(), 1.0) is None
    ok = p.parse(b"it 12 l 0.5", 1.0)
    assert isinstance(ok, Progress) and ok.step == 12


def test_parsed_floats_are_finite_or_a_nan_loss() -> None:
    from ftagent.sources.logformats import number

    assert number("1e309") is None and number("-inf") is None and number("9" * 400) is None
    nan = number("nan")
    assert nan is not None and nan != nan
    p = LogProgress()
    o = p.parse(b"step=3 loss=1e999 samples_per_second=" + b"9" * 400, 1.0)
    assert isinstance(o, Progress) and o.loss is None and o.samples_per_second is None


def test_regexes_are_linear_on_long_hostile_lines() -> None:
    """A 16 KB line of digits, blanks or delimiters after any needle costs every regex time
    linear in its length (the tqdm bar and ``ms/step`` regexes took seconds, quadratic)."""
    import re
    import time

    from ftagent.sources import logformats as lf

    heads = ["", "step", "loss", " 1%|", "train loss", "tok/s", "samples/s", "Step ", "1/2 [",
             "step=1, skipped=", "Epoch[1] Batch [", "iteration "]
    bodies = [" ", "1", "\t", "1.", " |", "1/", ": ", "1%", "%|", "1:"]
    rxs = [v for v in vars(lf).values() if isinstance(v, re.Pattern)]
    t0 = time.process_time()
    for h in heads:
        for b in bodies:
            line = (h + b * 16000)[:16000] + "x"
            for rx in rxs:
                rx.search(line)
    # ~3,400 searches of 16 KB: well under a second when linear, minutes when quadratic
    assert time.process_time() - t0 < 20
