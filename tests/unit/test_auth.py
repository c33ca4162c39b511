"""Job tokens, the authenticator chain and the one authorization rule (pure, no server)."""

from __future__ import annotations

import asyncio

import pytest

from ftagent.arbiter import auth
from ftagent.arbiter.auth import Presented, Principal, authorize, job_token, parse_job_token
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.server import ServerSettings, check_message, exposure_problem
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.checks import check_hello
from ftagent.wire.limits import OutOfRange

SECRET = "a-secret-of-enough-length"


def principal(chain: auth.Authenticator, bearer: str | None = None,
              certificate: str = "") -> Principal | None:
    return asyncio.run(chain.authenticate(Presented(bearer, certificate)))


def test_job_token_is_self_describing_and_deterministic() -> None:
    t = job_token(SECRET, "ml", "train")
    assert t == job_token(SECRET, "ml", "train")
    assert t.startswith("ftj1.bWw.dHJhaW4.")
    ns, job, mac = parse_job_token(t) or ("", "", b"")
    assert (ns, job, len(mac)) == ("ml", "train", 32)
    assert t != job_token(SECRET + "x", "ml", "train")


def test_the_encoding_is_unambiguous() -> None:
    tokens = {job_token(SECRET, ns, job) for ns, job in (
        ("", "ab"), ("a", "b"), ("ab", "x"), ("a.b", "c"), ("a", "b.c"),
        ("a\x00", "b"), ("a", "\x00b"))}
    assert len(tokens) == 7
    macs = {parse_job_token(t)[2] for t in tokens}  # type: ignore[index]
    assert len(macs) == 7  # distinct macs, not only distinct visible parts


@pytest.mark.parametrize("bad", [
    "", "ftj1", "ftj1...", "ftj1.bWw.dHJhaW4", "ftj2.bWw.dHJhaW4.AAAA",
    "ftj1.bWw.dHJhaW4.AAAA",  # mac too short
    "ftj1.bWw=.dHJhaW4." + "A" * 43,  # padding: not canonical
    "ftj1.bWx.dHJhaW4." + "A" * 43,  # non-canonical trailing bits ("bWx" != "bWw")
    "ftj1.bWw..AAAA",  # no job
    "ftj1.bWw.dHJh!W4." + "A" * 43,  # not base64url
    "ftj1.bWw.dHJhaW4." + "A" * 43 + ".x",
])
def test_malformed_job_tokens_do_not_parse(bad: str) -> None:
    assert parse_job_token(bad) is None


def test_job_token_needs_a_secret_and_a_job() -> None:
    with pytest.raises(ValueError):
        job_token("", "", "train")
    with pytest.raises(ValueError):
        job_token(SECRET, "", "")


def test_chain_with_a_secret() -> None:
    chain = auth.authenticator_for(SECRET, "")
    scoped = principal(chain, job_token(SECRET, "ml", "train"))
    assert scoped == Principal("job ml/train", namespace="ml", job="train")
    admin = principal(chain, SECRET)
    assert admin is not None and admin.admin
    for bad in (None, "", "nope", SECRET + " ", job_token("other-secret", "ml", "train"),
                job_token(SECRET, "ml", "train")[:-1] + "A"):
        assert principal(chain, bad) is None, bad
    # a certificate does not stand in for the token where the arbiter has a secret
    assert principal(chain, None, "CN=client") is None


def test_chain_with_client_certificates_only() -> None:
    chain = auth.authenticator_for("", "ca.pem")
    p = principal(chain, None, "client")
    assert p is not None and p.admin and "client" in p.name
    assert principal(chain, None, "") is None
    assert principal(chain, "some-token", "client") is None  # a token it cannot check


def test_chain_without_credentials_lets_everyone_be_admin() -> None:
    p = principal(auth.authenticator_for("", ""), None)
    assert p is not None and p.admin


def test_a_problem_with_the_metadata_is_refused_whatever_the_chain() -> None:
    chain = auth.authenticator_for("", "")
    assert asyncio.run(chain.authenticate(Presented(None, "", "two headers"))) is None


def test_presented_reads_bearer_metadata() -> None:
    assert Presented.from_call([("authorization", "Bearer abc")]) == Presented("abc")
    assert Presented.from_call([("authorization", "bearer  abc ")]).bearer == "abc"
    assert Presented.from_call([("x-other", "1")]) == Presented(None)
    assert Presented.from_call(None, [b"client"]) == Presented(None, "client")
    assert Presented.from_call([("authorization", "Basic abc")]).problem
    assert Presented.from_call([("authorization", "Bearer ")]).problem
    assert Presented.from_call([("authorization", "Bearer a"),
                                ("authorization", "Bearer a")]).problem


def test_authorize() -> None:
    admin = Principal("admin", admin=True)
    job = Principal("job ml/train", namespace="ml", job="train")
    bare = Principal("job train", namespace="", job="train")
    ns = Principal("namespace ml", namespace="ml")
    broken = Principal("no scope")
    assert authorize(admin, "any", "thing")
    assert authorize(job, "ml", "train")
    assert not authorize(job, "ml", "other") and not authorize(job, "", "train")
    assert not authorize(job, "prod", "train")
    assert authorize(bare, "", "train") and not authorize(bare, "ml", "train")
    assert authorize(ns, "ml", "anything") and not authorize(ns, "prod", "anything")
    assert not authorize(broken, "", "train")


@pytest.mark.parametrize("listen,loopback", [
    ("127.0.0.1:9400", True), ("127.8.0.1:0", True), ("localhost:1", True),
    ("[::1]:9400", True), ("[::ffff:127.0.0.1]:1", True), ("LOCALHOST.:1", True),
    ("0.0.0.0:9400", False), ("[::]:9400", False),
    ("10.0.0.1:9400", False), ("arbiter.example:9400", False),
])
def test_listens_on_loopback(listen: str, loopback: bool) -> None:
    assert auth.listens_on_loopback(listen) is loopback


def test_exposure_needs_credentials_or_insecure() -> None:
    wide = ServerSettings(listen="0.0.0.0:9400", policy=PolicyConfig())
    assert "--insecure" in exposure_problem(wide)
    assert exposure_problem(ServerSettings(listen="0.0.0.0:9400", token=SECRET)) == ""
    assert exposure_problem(ServerSettings(listen="0.0.0.0:9400", tls_client_ca="ca")) == ""
    assert exposure_problem(ServerSettings(listen="0.0.0.0:9400", insecure=True)) == ""
    assert exposure_problem(ServerSettings(listen="0.0.0.0:9400", tls_cert="c",
                                           tls_key="k")) != ""  # TLS alone proves nobody
    assert exposure_problem(ServerSettings(listen="127.0.0.1:9400")) == ""


def test_what_the_server_refuses_at_the_edge() -> None:
    check_hello(pb.Hello(job="j", rank=1, world_size=2, generation=3, max_restarts=0))
    for bad in (pb.Hello(rank=0, world_size=1),
                pb.Hello(job="j", rank=2, world_size=2),
                pb.Hello(job="j", rank=0, world_size=0),
                pb.Hello(job="j", rank=0, world_size=1, generation=2**63 - 1),
                pb.Hello(job="j", rank=0, world_size=1, generation=-2),
                pb.Hello(job="j", rank=0, world_size=1, restart_count=-1),
                pb.Hello(job="j", rank=0, world_size=1, max_restarts=-1),
                pb.Hello(job="j", rank=0, world_size=1, released_generation=2**40),
                pb.Hello(job="j\x1b[2J", rank=0, world_size=1),
                pb.Hello(job="j", pod="p" * 300, rank=0, world_size=1),
                pb.Hello(job="j", agent_instance="i" * 200, rank=0, world_size=1)):
        with pytest.raises(ValueError):
            check_hello(bad)
    check_message(pb.AgentMessage(arrival=pb.BarrierArrival(generation=2)))
    check_message(pb.AgentMessage(fault=pb.Fault(generation=2**63 - 1)))  # registry: ignored
    for msg in (pb.AgentMessage(arrival=pb.BarrierArrival(generation=2**63 - 1)),
                pb.AgentMessage(exit=pb.TrainerExit(generation=2**31)),
                pb.AgentMessage(ack=pb.Ack(command_id="c" * 200))):
        with pytest.raises(OutOfRange):
            check_message(msg)
