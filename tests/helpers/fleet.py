"""Worker descriptions for the router's fleet and registry tests."""

from __future__ import annotations

from infermesh.pb import common_pb2

BF16 = common_pb2.PRECISION_BF16


def info(
    worker_id: str, models=("m",), precision=BF16, max_parallel: int = 4, speed: float = 100.0
) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=worker_id,
        address=f"127.0.0.1:{1000 + len(worker_id)}",
        models=list(models),
        capabilities=common_pb2.Capabilities(
            device="cuda",
            precision=precision,
            max_parallel=max_parallel,
            decode_tokens_per_second=speed,
        ),
    )
