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
