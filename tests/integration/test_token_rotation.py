"""A real arbiter during a secret rotation: ``--token NEW --previous-token OLD`` accepts
tokens derived from either, and refuses an expired one (tests/unit/test_token_expiry.py
has the rules)."""

from __future__ import annotations

import time

import grpc

from ftagent.arbiter.auth import job_token
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer
from tests.arbiter_helpers import ArbiterProcess

NEW, OLD = "new-secret-0123456789", "old-secret-0123456789"


def test_the_arbiter_accepts_the_previous_secrets_tokens_during_a_rotation() -> None:
    with ArbiterProcess("--token", NEW, "--previous-token", OLD) as a, \
            grpc.insecure_channel(a.address) as ch:
        stub = pb_grpc.ArbiterStub(ch)
        for tok in (job_token(OLD, "", "train", int(time.time()) + 60),
                    job_token(NEW, "", "train", int(time.time()) + 60)):
            stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(tok), timeout=10)
        expired = job_token(NEW, "", "train", int(time.time()) - 1)
        try:
            stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(expired), timeout=10)
            raise AssertionError("an expired token was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED


def test_one_credential_holds_at_most_max_streams_per_identity() -> None:
    """Issue 20: one token could open unbounded streams. A job token holds at most one
    stream per rank (--max-ranks-per-job, 2 here): its third is RESOURCE_EXHAUSTED;
    closing one frees its place; the admin is not counted. (A pod's token: at most
    --max-streams-per-identity.)"""
    import asyncio

    from tests.arbiter_helpers import wait_until
    from tests.integration.test_arbiter_security import held_stream, hello, stream_status

    tok = job_token(NEW, "", "capped")

    async def body(address: str) -> None:
        async with held_stream(address, hello("capped", 0, 2), tok), \
                held_stream(address, hello("capped", 1, 2), tok):
            code, details = await asyncio.to_thread(
                stream_status, address, [hello("capped", 1, 2).SerializeToString()], tok,
                welcome_ends=True)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            assert "--max-ranks-per-job" in details
            async with held_stream(address, hello("other", 0, 1), NEW), \
                    held_stream(address, hello("other2", 0, 1), NEW), \
                    held_stream(address, hello("other3", 0, 1), NEW):
                pass  # the admin: not capped
        # the two closed (the server notices the cancel on its own time): room again
        async def room() -> bool:
            code, _ = await asyncio.to_thread(
                stream_status, address, [hello("capped", 1, 2).SerializeToString()], tok,
                welcome_ends=True)
            return code == grpc.StatusCode.OK

        await wait_until(room, 10, "the closed streams' places to free")

    with ArbiterProcess("--token", NEW, "--max-ranks-per-job", "2") as a:
        asyncio.run(body(a.address))
