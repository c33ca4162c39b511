"""``ftagent arbiter`` stopped by SIGTERM exits 0 even while a daemon thread is inside a
``kubernetes`` client call.

The client's API methods run inside pydantic-core's ``validate_call`` (Rust frames). A
daemon thread that wakes from such a call while the interpreter finalizes is ended with
pthread_exit, whose forced unwind cannot cross those frames: the process aborted (SIGABRT,
exit -6) after a clean stop, now and then, with --kube (an informer's watch read, woken
by the API server's next event). Here the thread is made to wake during finalization every
time (a child process keeps writing to it), around the real ``main`` with ``run`` replaced:
the old code aborted on every run of this test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pydantic")

SCRIPT = textwrap.dedent("""
    import subprocess, sys, threading
    from pydantic import validate_call
    import ftagent.cmd.arbiter as arbiter
    from ftagent.cli import main

    feeder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\\n"
        "while True:\\n"
        "    sys.stdout.write('event\\\\n'); sys.stdout.flush(); time.sleep(0.0002)\\n")],
        stdout=subprocess.PIPE)
    reading = threading.Event()

    @validate_call  # as every kubernetes client API method (kubernetes >= 35)
    def watch(limit: int) -> None:
        while True:
            feeder.stdout.readline(limit)
            reading.set()

    async def run(cfg):
        threading.Thread(target=watch, args=(1024,), daemon=True).start()
        reading.wait(30)
        # garbage for finalization to collect: the thread wakes while it does
        run.junk = [[{} for _ in range(10)] for _ in range(200_000)]
        return 0

    arbiter.run = run
    raise SystemExit(main(["arbiter", "--listen", "127.0.0.1:0", "--metrics-port", "-1"]))
""")


def test_sigterm_stop_with_a_kube_call_in_flight_exits_zero() -> None:
    got = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, timeout=60)
    assert got.returncode == 0, (got.returncode, got.stderr.decode()[-2000:])
