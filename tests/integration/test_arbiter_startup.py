"""``ftagent arbiter`` start-up failures, with the real process: one line, an exit status,
no traceback, no gRPC C-core noise, and nothing left bound."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PY, free_port, wait_for

NOISE = re.compile(r"^[EWID]\d{4} |Traceback|Exception ignored|RuntimeWarning", re.M)


def arbiter(*args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ftagent arbiter ARGS`` to its end (it must fail to start)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FTAGENT_")}
    environ.pop("GRPC_VERBOSITY", None)  # the arbiter's own default must keep gRPC quiet
    return subprocess.run([PY, "-m", "ftagent", "arbiter", *args], capture_output=True,
                          text=True, timeout=timeout, env={**environ, **(env or {})})


def one_line_error(r: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert not NOISE.search(r.stderr), r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ftagent arbiter: error: "), lines[0]
    assert "listening on" not in r.stderr and r.stdout == ""
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_grpc_port_in_use(busy_port: int) -> None:
    metrics = free_port()
    r = arbiter("--listen", f"127.0.0.1:{busy_port}", "--metrics-port", str(metrics),
                "--metrics-addr", "127.0.0.1")
    one_line_error(r, 1, f"cannot listen on 127.0.0.1:{busy_port}", "Address already in use",
                   "--listen")
    assert bindable(metrics), "the metrics port was left bound"


def test_metrics_port_in_use(busy_port: int) -> None:
    grpc_port = free_port()
    r = arbiter("--listen", f"127.0.0.1:{grpc_port}", "--metrics-port", str(busy_port),
                "--metrics-addr", "127.0.0.1")
    one_line_error(r, 1, f"cannot serve metrics on 127.0.0.1:{busy_port}",
                   "Address already in use", "--metrics-port")
    assert bindable(grpc_port), "the gRPC port was left bound"


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key"])
def test_missing_tls_file(tmp_path: Path, flag: str) -> None:
    (tmp_path / "present.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    files = {"--tls-cert": str(tmp_path / "present.pem"),
             "--tls-key": str(tmp_path / "present.pem"), flag: str(tmp_path / "absent.pem")}
    port = free_port()
    r = arbiter("--listen", f"127.0.0.1:{port}", "--metrics-port", "-1",
                *[x for kv in files.items() for x in kv])
    one_line_error(r, 2, flag, "absent.pem", "No such file or directory")
    assert bindable(port)


def test_garbled_tls_file(tmp_path: Path) -> None:
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    r = arbiter("--listen", "127.0.0.1:0", "--metrics-port", "-1",
                "--tls-cert", str(tmp_path / "junk.pem"), "--tls-key", str(tmp_path / "junk.pem"))
    one_line_error(r, 2, "--tls-cert", "no PEM certificate")


def test_unreadable_tls_file(tmp_path: Path) -> None:
    r = arbiter("--listen", "127.0.0.1:0", "--metrics-port", "-1",
                "--tls-cert", str(tmp_path), "--tls-key", str(tmp_path))  # a directory
    one_line_error(r, 2, "--tls-")


@pytest.mark.parametrize(("listen", "words"), [
    ("192.0.2.1:0", ["cannot listen on 192.0.2.1:0", "not an address of this host"]),
])
def test_address_not_on_this_host(listen: str, words: list[str]) -> None:
    r = arbiter("--listen", listen, "--metrics-port", "-1", "--token", "t" * 20)
    one_line_error(r, 1, *words)


@pytest.mark.parametrize("listen", ["127.0.0.1:65536", "127.0.0.1", "127.0.0.1:" + "9" * 4400,
                                    ":9400"])
def test_bad_listen_address(listen: str) -> None:
    r = arbiter("--listen", listen, "--metrics-port", "-1")
    one_line_error(r, 2, "--listen", "is not HOST:PORT")


@pytest.mark.parametrize("args", [[], ["--listen", "0.0.0.0:0"], ["--listen", "[::]:9400"],
                                  ["--listen", "0.0.0.0:0", "--no-insecure"]])
def test_beyond_loopback_without_authentication_is_refused(args: list[str]) -> None:
    r = arbiter(*args, "--metrics-port", "-1")
    line = one_line_error(r, 2, "refusing to listen on", "without authentication",
                          "--token (FTAGENT_TOKEN)", "--tls-client-ca", "--insecure")
    if not args:
        assert line == ("ftagent arbiter: error: refusing to listen on 0.0.0.0:9400 without "
                        "authentication: set --token (FTAGENT_TOKEN) or --tls-client-ca, or "
                        "--listen 127.0.0.1:9400, or --insecure (see ftagent arbiter --help)")


def test_nan_is_one_line() -> None:
    one_line_error(arbiter("--barrier-timeout", "nan"), 2, "--barrier-timeout",
                   "not a finite number")
    one_line_error(arbiter(env={"FTAGENT_STACKS_TIMEOUT": "-inf"}), 2,
                   "FTAGENT_STACKS_TIMEOUT")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_insecure_starts_with_one_warning(tmp_path: Path, how: str) -> None:
    err = tmp_path / "stderr"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FTAGENT_")}
    environ.pop("GRPC_VERBOSITY", None)
    args = ["--insecure"] if how == "flag" else []
    if how == "env":
        environ["FTAGENT_INSECURE"] = "1"
    with err.open("w") as f:
        proc = subprocess.Popen([PY, "-m", "ftagent", "arbiter", "--listen", "0.0.0.0:0",
                                 "--metrics-port", "-1", *args], stdout=subprocess.DEVNULL,
                                stderr=f, env=environ)
    try:
        warning = wait_for(lambda: re.search(r"^.* WARNING .*$", err.read_text(), re.M)
                           or proc.poll() is not None, 30, "the arbiter's warning")
        assert proc.poll() is None, err.read_text()
        text = err.read_text()
        m = re.search(r"^listening on 0\.0\.0\.0:(\d+)$", text, re.M)
        assert m, text
        port = int(m.group(1))
        assert isinstance(warning, re.Match)
        assert warning.group(0).endswith(
            f"listening on 0.0.0.0:{port} without authentication (--insecure): any peer can "
            "speak for any job")
        assert len(re.findall("WARNING", text)) == 1 and not NOISE.search(text), text
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0, err.read_text()
    assert not NOISE.search(err.read_text()), err.read_text()
    assert bindable(port, "0.0.0.0")


def test_loopback_without_token_needs_no_insecure(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FTAGENT_")}
    with err.open("w") as f:
        proc = subprocess.Popen([PY, "-m", "ftagent", "arbiter", "--listen", "127.0.0.1:0",
                                 "--metrics-port", "-1"], stdout=subprocess.DEVNULL, stderr=f,
                                env=environ)
    try:
        wait_for(lambda: "listening on" in err.read_text() or proc.poll() is not None, 30,
                 "the arbiter to listen")
        assert proc.poll() is None, err.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert "WARNING" not in err.read_text()
