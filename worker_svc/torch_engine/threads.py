"""The checkpoint engine's CPU thread policy: how many OpenMP threads torch computes on, and how
they wait between parallel regions.

torch 2.13's CPU wheel runs its intra-op parallelism and MKL on GNU OpenMP (libgomp, shipped in
torch/lib). Each op of a forward pass is a parallel region that ends only when every one of its
threads has run, so on a machine whose cores the gateway, the router, Redis and a client share, one
descheduled thread stalls every op: on a 2-core machine under a co-located aiperf run, torch's
default (2 threads, libgomp's waiting) served 6 output tokens/s where one thread served 156 (issue
#30; docs/benchmarks/thread-policy.md). The policy therefore computes on the
cores available to the process (``os.sched_getaffinity``) less ``[engine] reserved_cores`` for the
services beside it, at least one.

Waiting: libgomp honours ``OMP_WAIT_POLICY`` (and ``GOMP_SPINCOUNT``; Intel's ``KMP_BLOCKTIME`` is
not read), and only as the library loads, so it is set in the environment before torch is first
imported (:func:`apply`); ``torch.set_num_threads`` then sets the thread count every thread starts
with (the step loop's thread included). ``passive`` sleeps at once between regions, leaving the
cores to the other services; ``active`` spins; ``runtime`` leaves libgomp's own (spin a while, then
sleep). ``auto`` is passive: with 2 threads on those 2 cores under the same load, passive served
128 tokens/s, libgomp's own waiting 6 and active 12, since a spinning thread holds the core another
service, or its own sibling thread, needs. With one thread there is no pool, and nothing waits.
Threads are not bound to cores: bound (``OMP_PROC_BIND=close``, ``OMP_PLACES=cores``) 2 threads
served 10 tokens/s, against 6 unbound with the same waiting and far below passive waiting or one
thread; a bound thread waits for its one core where the scheduler could move it to a free one.
An ``OMP_PROC_BIND`` in the environment is still honoured by libgomp, and logged.

GPU workers take the same policy: torch's CPU threads there only run the CPU side (the scheduler's
tensors, sampling's and the grammar masks' host work), and a pool that spins between those small
regions takes cores from the step loop that launches the GPU's kernels; passive waiting and the
reserved cores keep the step loop, the event loop and gRPC scheduled (reasoned from the CPU
measurements, not measured on a GPU).

An operator's ``OMP_NUM_THREADS`` / ``OMP_WAIT_POLICY`` in the environment is kept where the config
says ``auto``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from typing import Literal

from worker_svc.config import AUTO_THREADS, WaitPolicy

logger = logging.getLogger(__name__)

ChosenWaitPolicy = Literal["passive", "active", "runtime"]
# OMP_WAIT_POLICY's values as libgomp reads them (any case)
_GIVEN_WAIT_POLICIES: dict[str, ChosenWaitPolicy] = {
    "passive": "passive",
    "active": "active",
}


@dataclasses.dataclass(frozen=True)
class ThreadPolicy:
    """What the engine computes on: ``threads`` OpenMP threads waiting as ``wait_policy``
    (``passive``, ``active`` or ``runtime``: libgomp's default), and why."""

    threads: int
    wait_policy: ChosenWaitPolicy
    why: str
    binding: str = ""  # OMP_PROC_BIND as the environment gave it (the policy binds nothing)

    def environment(self) -> dict[str, str]:
        """The variables libgomp reads as it loads (none for its own wait policy)."""
        if self.wait_policy == "runtime":
            return {}
        return {"OMP_WAIT_POLICY": self.wait_policy.upper()}

    def describe(self) -> str:
        bound = f"bound as OMP_PROC_BIND={self.binding}" if self.binding else "not bound to cores"
        return (
            f"torch threads: {self.threads} ({self.why}); OpenMP wait policy {self.wait_policy}; "
            f"threads {bound}"
        )


def choose_threads(
    cores: int,
    threads: int = AUTO_THREADS,
    reserved_cores: int = 1,
    wait_policy: WaitPolicy = "auto",
    environ: Mapping[str, str] | None = None,
) -> ThreadPolicy:
    """The policy for a process that may run on ``cores`` cores, under ``[engine] threads``,
    ``reserved_cores`` and ``omp_wait_policy``; ``environ``'s OMP_NUM_THREADS and OMP_WAIT_POLICY
    stand where those say auto."""
    environ = {} if environ is None else environ
    if threads != AUTO_THREADS:
        count, why = threads, "[engine] threads"
    elif environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        count, why = int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        count = max(1, cores - reserved_cores)
        why = f"{cores} cores available, {reserved_cores} reserved for the services beside it"
    binding = environ.get("OMP_PROC_BIND", "")
    unbound = binding.lower() in ("", "false")
    return ThreadPolicy(count, _wait_policy(wait_policy, environ), why, "" if unbound else binding)


def _wait_policy(wait_policy: WaitPolicy, environ: Mapping[str, str]) -> ChosenWaitPolicy:
    if wait_policy != "auto":
        return wait_policy
    return _GIVEN_WAIT_POLICIES.get(environ.get("OMP_WAIT_POLICY", "").lower(), "passive")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0))


def apply(policy: ThreadPolicy) -> None:
    """Puts ``policy`` in force for this process: the wait policy into the environment, then torch
    imported and told the thread count. Call it before anything imports torch: libgomp reads its
    environment once, as it loads."""
    if "torch" in sys.modules and policy.environment():
        logger.warning(
            "torch was imported before the thread policy: its OpenMP wait policy stays as loaded"
        )
    os.environ.update(policy.environment())
    # imported here, after the environment is set, so that libgomp loads under it
    import torch

    torch.set_num_threads(policy.threads)
    logger.info(policy.describe())
