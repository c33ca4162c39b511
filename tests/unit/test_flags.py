"""Every flag of every command: ranges, NaN/inf, huge numbers, identity, --help.

The numeric cases are generated from the dataclass fields, so a new int or float flag is
covered without touching this file (and fails here if it has no ``Range``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, get_type_hints

import pytest

from ftagent.cmd import arbiter as arbiter_cli
from ftagent.cmd import run as run_cli
from ftagent.cmd import status as status_cli
from ftagent.config import (
    CONNECTION_FIELDS,
    RUN_GROUPS,
    ArbiterClientConfig,
    ConfigError,
    IdentityConfig,
    Range,
    StatusConfig,
    identity,
)
from ftagent.wire.limits import MAX_NAME, MAX_WORLD_SIZE

HUGE = "9" * 4400  # past int()'s 4,300-digit limit
# What a value needs beside it to be valid (a rank needs a world size above it).
COMPANIONS = {"--rank": ["--world-size", str(MAX_WORLD_SIZE)]}


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    parse: Callable[[list[str], Mapping[str, str]], Any]
    main: Callable[[list[str]], int]
    parser: Callable[[], argparse.ArgumentParser]
    groups: tuple[tuple[type[Any], tuple[str, ...] | None], ...]  # (dataclass, only)


COMMANDS = (
    Command("run", lambda argv, env: run_cli.parse([*argv, "--", "true"], env),
            lambda argv: run_cli.main([*argv, "--", "true"]), run_cli.build_parser,
            tuple((cls, None) for _, cls in RUN_GROUPS.values())),
    Command("arbiter", lambda argv, env: arbiter_cli.parse(argv, env), arbiter_cli.main,
            arbiter_cli.build_parser, ((arbiter_cli.ArbiterConfig, None),)),
    Command("status", lambda argv, env: status_cli.parse(argv, env), status_cli.main,
            status_cli.build_parser,
            ((StatusConfig, None), (ArbiterClientConfig, CONNECTION_FIELDS))),
)


def fields(cmd: Command) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    for cls, only in cmd.groups:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if only is None or f.name in only:
                yield f, hints[f.name]


def numeric_fields() -> list[Any]:
    return [pytest.param(cmd, f, typ, id=f"{cmd.name}{f.metadata['flag']}")
            for cmd in COMMANDS for f, typ in fields(cmd) if typ in (int, float)]


def bad_values(r: Range, typ: type) -> list[str]:
    specials = {v for v, _ in r.also}
    below = r.lo - 1
    while below in specials:
        below -= 1
    values = ["nan", "NaN", "inf", "-inf", "1e400", "-1e400", HUGE, "-" + HUGE,
              "1" + "0" * 400, "-1e12", "1e12", "", "x", "1,5", _text(r.hi + 1, typ),
              _text(below, typ)]
    if r.lo_open:
        values.append(_text(r.lo, typ))
    if typ is int:
        values += ["1.5", "1e3", str(2**63), str(-(2**63))]
    return values


def good_values(r: Range, typ: type, default: Any) -> list[str]:
    values = [_text(r.hi, typ), str(default)] + [str(v) for v, _ in r.also]
    if not r.lo_open:
        values.append(_text(r.lo, typ))
    return values


def _text(v: float, typ: type) -> str:
    return str(int(v)) if typ is int else repr(float(v))


def test_every_numeric_flag_has_a_finite_range() -> None:
    seen = 0
    for cmd in COMMANDS:
        for f, typ in fields(cmd):
            if typ in (int, float):
                r = f.metadata["check"]
                assert isinstance(r, Range), f"{cmd.name} {f.metadata['flag']} has no Range"
                assert math.isfinite(r.lo) and math.isfinite(r.hi) and r.lo <= r.hi
                assert r.hi <= 2**31 - 1 and r.lo >= -1
                seen += 1
    assert seen >= 20


@pytest.mark.parametrize(("cmd", "f", "typ"), numeric_fields())
def test_numeric_flag_refuses_out_of_range_nan_inf_and_huge(
        cmd: Command, f: dataclasses.Field[Any], typ: type) -> None:
    r = f.metadata["check"]
    flag, env = f.metadata["flag"], f.metadata["env"]
    for value in bad_values(r, typ):
        for argv, environ, source in (([f"{flag}={value}"], {}, flag),
                                      ([], {env: value}, env)):
            if not value and not argv:
                continue  # an empty variable means unset
            with pytest.raises((ConfigError, SystemExit)) as info:
                cmd.parse(argv, environ)
            if info.type is ConfigError:
                message = str(info.value)
                assert "\n" not in message and len(message) < 400, message
                assert source in message, message
            else:
                assert isinstance(info.value, SystemExit) and info.value.code == 2


@pytest.mark.parametrize(("cmd", "f", "typ"), numeric_fields())
def test_numeric_flag_accepts_its_bounds_and_default(
        cmd: Command, f: dataclasses.Field[Any], typ: type) -> None:
    r = f.metadata["check"]
    extra = COMPANIONS.get(f.metadata["flag"], [])
    for value in good_values(r, typ, f.default):
        cmd.parse([f"{f.metadata['flag']}={value}", *extra], {})
        cmd.parse(extra, {f.metadata["env"]: value})


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.name)
@pytest.mark.parametrize("value", ["nan", "-inf", HUGE, "-7"])
def test_bad_number_is_one_line_and_exit_2(cmd: Command, value: str,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)  # main() may set a default
    for f, typ in fields(cmd):
        if typ in (int, float) and f.metadata["check"].lo >= 0:
            break
    for argv in ([f"{f.metadata['flag']}={value}"], [f.metadata["flag"], value]):
        try:
            code = cmd.main(argv)
        except SystemExit as e:  # argparse's own errors (OneLineParser)
            code = int(e.code or 0)
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith(f"ftagent {cmd.name}: error: "), err
        assert "Traceback" not in err and len(err) < 400


def test_nan_through_the_environment_is_refused(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTAGENT_NIC_POLL_INTERVAL", "nan")
    assert run_cli.main(["--", "true"]) == 2
    err = capsys.readouterr().err
    assert err == ("ftagent run: error: FTAGENT_NIC_POLL_INTERVAL: 'nan' is not a finite "
                   "number (see ftagent run --help)\n")


def test_huge_number_is_shown_short() -> None:
    with pytest.raises(ConfigError, match=r"\(4400 characters\) is not a valid int"):
        run_cli.parse([f"--max-restarts={HUGE}", "--", "true"], {})


# --------------------------------------------------------------------------- identity


def ident(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None
          ) -> IdentityConfig:
    return run_cli.parse([*argv, "--", "true"], dict(environ or {})).identity


@pytest.mark.parametrize(("argv", "environ", "wanted"), [
    ([], {}, (0, 1)),
    (["--rank", "1", "--world-size", "2"], {}, (1, 2)),
    ([], {"RANK": "3", "WORLD_SIZE": "4"}, (3, 4)),
    ([], {"GROUP_RANK": "1", "PET_NNODES": "2"}, (1, 2)),
    ([], {"PET_NODE_RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),
    (["--rank", "0"], {"RANK": "5", "WORLD_SIZE": "6"}, (0, 6)),
    (["--world-size", "8"], {"RANK": "7", "WORLD_SIZE": "2"}, (7, 8)),
    ([], {"FTAGENT_RANK": "2", "FTAGENT_WORLD_SIZE": "3", "RANK": "9"}, (2, 3)),
    ([], {"WORLD_SIZE": str(MAX_WORLD_SIZE), "RANK": str(MAX_WORLD_SIZE - 1)},
     (MAX_WORLD_SIZE - 1, MAX_WORLD_SIZE)),
])
def test_rank_and_world_size_sources(argv: list[str], environ: dict[str, str],
                                     wanted: tuple[int, int]) -> None:
    ids = ident(argv, environ)
    assert (ids.rank, ids.world_size) == wanted


@pytest.mark.parametrize(("argv", "environ", "words"), [
    (["--rank", "-7"], {}, ["--rank", "'-7'", "[0, 999999]"]),
    (["--rank=-7"], {}, ["--rank", "'-7'"]),
    (["--rank", "5", "--world-size", "2"], {}, ["rank 5 (from --rank)", "[0, 2)",
                                                "world size is 2 (from --world-size)"]),
    (["--rank", "2", "--world-size", "2"], {}, ["rank 2 (from --rank)"]),
    (["--rank", "3"], {}, ["rank 3 (from --rank)", "from the default"]),
    (["--world-size", "0"], {}, ["--world-size", "'0'"]),
    (["--world-size", str(MAX_WORLD_SIZE + 1)], {}, ["--world-size"]),
    ([], {"RANK": "5", "WORLD_SIZE": "2"}, ["rank 5 (from $RANK)", "(from $WORLD_SIZE)"]),
    ([], {"RANK": "-3", "WORLD_SIZE": "2"}, ["rank -3 (from $RANK)"]),
    ([], {"GROUP_RANK": "4", "PET_NNODES": "4"}, ["from $GROUP_RANK", "from $PET_NNODES"]),
    ([], {"WORLD_SIZE": "0"}, ["world size 0 (from $WORLD_SIZE)"]),
    ([], {"WORLD_SIZE": "-2"}, ["world size -2 (from $WORLD_SIZE)"]),
    ([], {"PET_NNODES": str(MAX_WORLD_SIZE + 1)}, ["from $PET_NNODES", "[1, 1000000]"]),
    ([], {"RANK": "abc"}, ["$RANK", "'abc' is not a valid int", "--rank"]),
    ([], {"WORLD_SIZE": HUGE}, ["$WORLD_SIZE", "(4400 characters)"]),
    ([], {"RANK": "9" * 4000, "WORLD_SIZE": "2"}, ["(4000 digits)", "$RANK"]),
    ([], {"FTAGENT_RANK": "3"}, ["rank 3 (from FTAGENT_RANK)", "the default"]),
    ([], {"FTAGENT_RANK": "1", "FTAGENT_WORLD_SIZE": "1"},
     ["from FTAGENT_RANK", "from FTAGENT_WORLD_SIZE"]),
    (["--world-size", "2"], {"RANK": "2"}, ["from $RANK", "from --world-size"]),
])
def test_rank_and_world_size_refused_naming_the_source(
        argv: list[str], environ: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ident(argv, environ)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400
    for w in words:
        assert w in message, message


@pytest.mark.parametrize(("argv", "environ", "words"), [
    (["--job", "a\nb"], {}, ["--job", "control characters"]),
    (["--job", "j" * (MAX_NAME + 1)], {}, ["--job", f"at most {MAX_NAME}"]),
    (["--namespace", "n\x1b[31m"], {}, ["--namespace"]),
    (["--pod", "p\x00"], {}, ["--pod"]),
    (["--node", "n" * 1000], {}, ["--node", "1000 characters"]),
    ([], {"FTAGENT_JOB": "a\tb"}, ["FTAGENT_JOB"]),
    ([], {"TORCHELASTIC_RUN_ID": "r" * 300}, ["$TORCHELASTIC_RUN_ID", "300 characters"]),
    ([], {"POD_NAMESPACE": "ns\n"}, ["$POD_NAMESPACE"]),
    ([], {"POD_NAME": "pod\x7f"}, ["$POD_NAME"]),
    ([], {"NODE_NAME": "x" * 254}, ["$NODE_NAME"]),
    ([], {"HOSTNAME": "h\nx"}, ["$HOSTNAME"]),
])
def test_names_are_checked_like_the_wire_checks_them(
        argv: list[str], environ: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ident(argv, environ)
    for w in words:
        assert w in str(info.value)
    assert "\n" not in str(info.value)


def test_names_within_limits_pass() -> None:
    ids = ident(["--job", "j" * MAX_NAME], {"POD_NAME": "p-0", "NODE_NAME": "n1",
                                            "POD_NAMESPACE": "ml"})
    assert (ids.job, ids.pod, ids.node, ids.namespace) == ("j" * MAX_NAME, "p-0", "n1", "ml")


U1, U2 = "GPU-6f3a1c2e-88d1-4f3e-9a2b-1c2d3e4f5a6b", "GPU-0b1c2d3e-4f5a-6b7c-8d9e-0f1a2b3c4d5e"


@pytest.mark.parametrize(("argv", "environ", "wanted"), [
    ([], {}, ()),
    ([], {"NVIDIA_VISIBLE_DEVICES": f"{U1},{U2}"}, (U1, U2)),  # the device plugin's default
    ([], {"NVIDIA_VISIBLE_DEVICES": "0,3"}, ("0", "3")),  # deviceIDStrategy=index
    ([], {"NVIDIA_VISIBLE_DEVICES": "all"}, ()),  # says nothing about which GPUs
    ([], {"NVIDIA_VISIBLE_DEVICES": "none"}, ()),
    ([], {"NVIDIA_VISIBLE_DEVICES": "void"}, ()),
    ([], {"NVIDIA_VISIBLE_DEVICES": f"{U1},all"}, ()),
    ([], {"ASCEND_VISIBLE_DEVICES": "2,5-7"}, ("2", "5", "6", "7")),  # Ascend Docker Runtime
    ([], {"ASCEND_VISIBLE_DEVICES": "0-99999"}, ()),
    ([], {"NVIDIA_VISIBLE_DEVICES": "0", "ASCEND_VISIBLE_DEVICES": "3"}, ("0",)),
    (["--gpus", U2], {"NVIDIA_VISIBLE_DEVICES": U1}, (U2,)),  # the flag wins
    (["--gpus", f"{U1}, {U2}"], {}, (U1, U2)),
    (["--gpus", "1", "--gpus", "2"], {}, ("1", "2")),
    ([], {"FTAGENT_GPUS": f"{U1},{U2}"}, (U1, U2)),
    ([], {"FTAGENT_GPUS": "MIG-5c2a9c1e-7d4b-5e8f-a1b2-c3d4e5f6a7b8"},
     ("MIG-5c2a9c1e-7d4b-5e8f-a1b2-c3d4e5f6a7b8",)),
])
def test_the_pods_gpus_from_the_flag_or_the_device_plugin(
        argv: list[str], environ: dict[str, str], wanted: tuple[str, ...]) -> None:
    assert ident(argv, environ).gpus == wanted


@pytest.mark.parametrize(("argv", "environ", "words"), [
    (["--gpus", "cuda:0"], {}, ["--gpus", "'cuda:0'", "neither a GPU UUID"]),
    (["--gpus", "GPU-a\nb"], {}, ["--gpus"]),
    ([], {"FTAGENT_GPUS": "x" * 100}, ["FTAGENT_GPUS", "(100 characters)"]),
    (["--gpus", ",".join(str(i) for i in range(65))], {}, ["65 GPUs", "at most 64"]),
    ([f"--gpus={i}" for i in range(65)], {}, ["--gpus names 65 GPUs"]),
])
def test_bad_gpu_ids_are_refused_in_one_line(argv: list[str], environ: dict[str, str],
                                             words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ident(argv, environ)
    for w in words:
        assert w in str(info.value), info.value
    assert "\n" not in str(info.value)


def test_identity_without_origins_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"rank 4 \(from --rank\)"):
        identity(IdentityConfig(rank=4, world_size=2), {})


# --------------------------------------------------------------------------- other values


@pytest.mark.parametrize(("cmd", "argv", "words"), [
    ("run", ["--arbiter", "host:99999999999"], ["--arbiter", "is not HOST:PORT"]),
    ("run", ["--arbiter", "host:" + HUGE], ["--arbiter", "characters"]),
    ("run", ["--arbiter", "a:1,b:0"], ["port 0", "'b:0'"]),
    ("run", ["--arbiter", ":9400"], ["is not HOST:PORT"]),
    ("run", ["--metrics-addr", "a b"], ["--metrics-addr"]),
    ("run", ["--progress-regex", "("], ["--progress-regex", "regular expression"]),
    ("arbiter", ["--listen", "0.0.0.0:65536"], ["--listen", "HOST:PORT"]),
    ("arbiter", ["--listen", "0.0.0.0:" + HUGE], ["--listen"]),
    ("arbiter", ["--listen", "9400"], ["--listen"]),
    ("arbiter", ["--metrics-addr", ""], ["--metrics-addr"]),
    ("status", ["--arbiter", "x"], ["--arbiter"]),
    ("status", ["--namespace", "a\nb"], ["--namespace", "control characters"]),
    ("status", ["j" * 300], ["JOB", "300 characters"]),
])
def test_other_values_refused_in_one_line(cmd: str, argv: list[str], words: list[str]) -> None:
    command = next(c for c in COMMANDS if c.name == cmd)
    with pytest.raises(ConfigError) as info:
        command.parse(argv, {})
    for w in words:
        assert w in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("yes", True), ("0", False),
                                                 ("off", False)])
def test_bool_variables(value: str, expected: bool) -> None:
    assert arbiter_cli.parse([], {"FTAGENT_INSECURE": value}).insecure is expected


def test_bad_bool_variable_refused() -> None:
    with pytest.raises(ConfigError, match="FTAGENT_INSECURE: 'maybe' is not a valid bool"):
        arbiter_cli.parse([], {"FTAGENT_INSECURE": "maybe"})


# --------------------------------------------------------------------------- authority


@pytest.mark.parametrize(("argv", "allowed"), [
    ([], False),
    (["--listen", "0.0.0.0:9400"], False),
    (["--listen", "[::]:9400"], False),
    (["--listen", "10.0.0.5:9400"], False),
    (["--listen", "arbiter.example:9400"], False),
    (["--tls-cert", "c", "--tls-key", "k"], False),  # TLS alone authenticates nobody
    (["--listen", "127.0.0.1:9400"], True),
    (["--listen", "127.8.9.1:0"], True),
    (["--listen", "[::1]:9400"], True),
    (["--listen", "localhost:9400"], True),
    (["--token", "s3cret-s3cret-s3cret"], True),
    (["--tls-client-ca", "ca.pem"], True),
    (["--insecure"], True),
])
def test_beyond_loopback_needs_authentication(argv: list[str], allowed: bool) -> None:
    cfg = arbiter_cli.parse(argv, {})
    if allowed:
        arbiter_cli.check_authority(cfg)
        return
    with pytest.raises(ConfigError) as info:
        arbiter_cli.check_authority(cfg)
    assert str(info.value) == (
        f"refusing to listen on {cfg.listen} without authentication: set --token "
        f"(FTAGENT_TOKEN) or --tls-client-ca, or --listen 127.0.0.1:9400, or --insecure")


def test_insecure_from_the_environment() -> None:
    arbiter_cli.check_authority(arbiter_cli.parse([], {"FTAGENT_INSECURE": "1"}))
    arbiter_cli.check_authority(arbiter_cli.parse([], {"FTAGENT_TOKEN": "t" * 20}))


# --------------------------------------------------------------------------- --help


def placeholders(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's placeholder as --help prints it."""
    fmt = parser._get_formatter()
    out = {}
    for action in parser._actions:
        if action.option_strings and action.nargs != 0:
            out[action.option_strings[-1]] = fmt._format_args(
                action, fmt._get_default_metavar_for_optional(action))
    return out


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.name)
def test_help_placeholders_are_words_not_internal_names(cmd: Command) -> None:
    parser = cmd.parser()
    found = placeholders(parser)
    assert found
    for flag, shown in found.items():
        assert "CONFIG" not in shown.upper() and not re.search(r"\w\.\w", shown), (flag, shown)
    text = parser.format_help()
    for usage in re.findall(r"--[\w-]+ ([A-Z][A-Z0-9_.:\[\],]*)", text):  # not examples
        assert "CONFIG" not in usage and not re.search(r"\w\.\w", usage), usage


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.name)
def test_help_shows_every_flag_with_its_variable(cmd: Command) -> None:
    text = re.sub(r"\s+", " ", cmd.parser().format_help())
    for f, _ in fields(cmd):
        assert f.metadata["flag"] in text
        assert f"[env {f.metadata['env']}]" in text, f.metadata["env"]
    assert ":7460" not in text


def test_status_help_shows_only_the_flags_status_uses() -> None:
    text = status_cli.build_parser().format_help()
    assert "--arbiter-fail-open-after" not in text and "ARBITER_FAIL_OPEN" not in text
    for flag in ("--arbiter", "--token", "--tls-ca", "--tls-cert", "--tls-key", "--timeline",
                 "--namespace", "--json", "--follow"):
        assert flag in text


def test_status_refuses_agent_only_flags() -> None:
    with pytest.raises(SystemExit) as info:
        status_cli.parse(["--arbiter-fail-open-after", "3"], {})
    assert info.value.code == 2


def test_status_ignores_agent_only_variables() -> None:
    _, _, cfg = status_cli.parse([], {"FTAGENT_ARBITER_FAIL_OPEN_AFTER": "nan",
                                      "FTAGENT_ARBITER": "a:9400"})
    assert cfg.arbiter == "a:9400"


def test_arbiter_token_help() -> None:
    text = re.sub(r"\s+", " ", arbiter_cli.build_parser().format_help())
    assert ("secret: peers present it (admin) or a job token derived from it (`ftagent token "
            "--job JOB`)") in text
    assert "--insecure" in text and "FTAGENT_INSECURE" in text
    assert "exit status" in text


def test_every_command_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as info:
            cmd.parser().parse_args(["--help"])
        assert info.value.code == 0
        assert "usage: ftagent " + cmd.name in capsys.readouterr().out
