"""An operator reaches a deployed arbiter as docs/runbooks.md says (issue 32): through
``kubectl port-forward`` (here: the arbiter on loopback, as the forward presents it), TLS
verified with ``ca.crt`` of the Secret ``ftagent-arbiter-tls`` the arbiter made, and a
pod-bound ServiceAccount token (what ``kubectl create token SA --audience ftagent
--bound-object-kind Pod --bound-object-name POD`` returns; minted by the fake API server,
reviewed as the real one reviews it). Before: the self-signed certificate named only the
Service's DNS names, so ``--arbiter localhost:9400`` failed the TLS name check (reported as
"unreachable")."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from tests.arbiter_helpers import ArbiterProcess  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402

SECRET = "admin-secret-0123456789"  # so that no anonymous caller exists
ARBITER_NS = "ftagent-system"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        fake.add_node("n1")
        fake.add_pod("ml", "llama-0", labels={"ftagent.io/job": "llama"}, node="n1")
        yield fake


def status(address: str, ca: Path, token: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTAGENT_")}
    env.update(PYTHONPATH=str(ROOT), FTAGENT_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "ftagent", "status", "--arbiter", address,
                           "--tls-ca", str(ca), "--json"],
                          capture_output=True, text=True, timeout=120, env=env)


def test_port_forward_with_a_pod_bound_token(kube: FakeKube, tmp_path: Path) -> None:
    # the deployed arbiter's flags (deploy/components/arbiter), on loopback
    with ArbiterProcess("--kube", "--kube-api", kube.url, "--token", SECRET,
                        "--metrics-port", "-1", "--tls-secret", "ftagent-arbiter-tls",
                        env={"POD_NAMESPACE": ARBITER_NS}) as a:
        secret = kube.get("secrets", "ftagent-arbiter-tls", ARBITER_NS)
        assert secret is not None
        ca = tmp_path / "arbiter-ca.crt"
        ca.write_bytes(base64.b64decode(secret["data"]["ca.crt"]))
        port = a.address.rpartition(":")[2]
        token = kube.mint_token("ml", "default", pod="llama-0").token
        r = status(f"localhost:{port}", ca, token)
        assert r.returncode == 0, r.stderr
        # a token the API server does not vouch for is refused, not anonymous
        bad = status(f"localhost:{port}", ca, "not-a-token")
        assert bad.returncode != 0 and "unreachable" not in bad.stderr
