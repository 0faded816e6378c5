"""The sending side of the shared streams: messages kept within gRPC's size limit."""

from __future__ import annotations

import grpc
import pytest

from infermesh.bidi import MAX_MESSAGE_BYTES, check_size, split
from infermesh.pb import common_pb2, worker_pb2


def _open(request_id: int, prompt_bytes: int) -> worker_pb2.OpenRequest:
    return worker_pb2.OpenRequest(
        id=request_id, request=common_pb2.GenerateRequest(model="m", prompt="x" * prompt_bytes)
    )


def test_a_message_past_the_limit_is_split_in_order_within_it():
    message = worker_pb2.StreamRequest(
        open=[_open(i, 1_500_000) for i in range(1, 6)], cancel=[7, 8]
    )
    parts = split(message)
    assert len(parts) > 1 and all(p.ByteSize() <= MAX_MESSAGE_BYTES for p in parts)
    assert [o.id for p in parts for o in p.open] == [1, 2, 3, 4, 5]
    assert [c for p in parts for c in p.cancel] == [7, 8]
    small = worker_pb2.StreamRequest(open=[_open(1, 10)])
    assert split(small) == [small]


def test_a_request_past_the_limit_is_refused_as_grpc_would():
    check_size(_open(1, 1000).request)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        check_size(_open(1, MAX_MESSAGE_BYTES).request)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in e.value.details()
