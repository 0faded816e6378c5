"""What a service learns of the fleet from its WorkerStatus list (the router's ListWorkers): per
served model, the value most of its workers report."""

from __future__ import annotations

import collections
from collections.abc import Callable

from infermesh.pb import common_pb2, router_pb2


def per_model(
    workers: list[router_pb2.WorkerStatus], value_of: Callable[[common_pb2.WorkerInfo], str | None]
) -> dict[str, str]:
    """Per served model the value ``value_of`` gives most of its workers; a worker it gives None
    does not count."""
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for status in workers:
        value = value_of(status.worker)
        if value is None:
            continue
        for model in status.worker.models:
            counts[model][value] += 1
    return {model: count.most_common(1)[0][0] for model, count in counts.items()}
