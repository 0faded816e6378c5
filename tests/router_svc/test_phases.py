"""Whether the router splits a request's phases (router_svc/phases.py), on the real Chooser over
a real Fleet: only when serving it aggregated would stall the streams decoding on its worker
past the inter-token objective and the split's first token comes no later."""

from __future__ import annotations

import grpc
import pytest

from infermesh.config import ConfigError, load_config
from infermesh.pb import common_pb2
from infermesh.prefix_hash import chain
from infermesh.sim_tokens import prompt_text, sim_token_ids
from router_svc.config import RouterConfig, RoutingSection
from router_svc.fleet import Fleet
from router_svc.routing import Chooser, Decision
from telemetry import metrics
from tests.helpers import MODEL
from tests.helpers.fleet import info
from tests.helpers.inprocess import (
    register_unreachable_worker,
    running_router,
    running_worker,
    sim_engine,
)
from tests.router_svc.test_kv_pull import V3_BYTES_PER_TOKEN
from tests.router_svc.test_routing import fleet_of, with_hashes

# served by a worker that reports no tokenizer: nothing to hash its prompts with
_NO_TOKENIZER_MODEL = "no-tokenizer-model"


def _fleet(*workers: tuple[str, str, float], decoding: dict[str, int]) -> Fleet:
    """Workers (name, role, prefill tokens/s) decoding 100 tokens/s a stream, prefilling in
    256-token chunks beside decodes, with DeepSeek-V3's KV size; ``decoding``: streams running."""
    infos = [info(name, max_parallel=8) for name, _, _ in workers]
    for worker, (_, role, prefill_speed) in zip(infos, workers, strict=True):
        caps = worker.capabilities
        caps.role, caps.prefill_tokens_per_second = role, prefill_speed
        caps.prefill_chunk_tokens, caps.kv_transfer_bytes_per_token = 256, V3_BYTES_PER_TOKEN
    return fleet_of(*infos, running=decoding)


def _decide(fleet: Fleet, tokens: int, **routing: float) -> Decision:
    hashes = chain(list(range(tokens)))
    return Chooser(RoutingSection(**routing)).choose(fleet, with_hashes(hashes))  # type: ignore[arg-type]


def test_a_short_prompt_beside_a_busy_decode_stays_local():
    # 320 tokens on D at 2,000/s: 2 chunks of 0.128 s and 0.032 s, each beside a 0.01 s step;
    # the first stalls D's streams past 0.1 s, but split on P its first token is later (0.032 s
    # on P, 0.18 s of transfer over 1 Gb/s) than D's own (0.18 s)
    fleet = _fleet(("p", "prefill", 10_000), ("d", "decode", 2_000), decoding={"d": 4})
    slow_link = _decide(fleet, 320, link_gbps=1)
    assert slow_link.workers[0].worker_id == "d" and slow_link.pull is None
    assert (slow_link.phases.plan, slow_link.phases.term) == ("aggregated", "first_token")
    # a prompt of one block beside D's streams: 16 tokens, 8 ms, within the objective
    short = _decide(fleet, 16, link_gbps=100)
    assert short.pull is None and (short.phases.plan, short.phases.term) == ("aggregated", "gap")
    assert short.reasons["phase_plan"] == "aggregated" and short.reasons["phase_term"] == "gap"


def test_a_long_fresh_prompt_beside_busy_decodes_splits():
    # 16,000 tokens: D's 256-token chunks stall its 4 streams 0.138 s each, and its own prefill
    # (8 s and 63 steps) comes after P's (1.6 s and 0.09 s of transfer over 100 Gb/s)
    fleet = _fleet(("p", "prefill", 10_000), ("d", "decode", 2_000), decoding={"d": 4})
    decision = _decide(fleet, 16_000, link_gbps=100)
    assert decision.workers[0].worker_id == "d"
    assert (decision.phases.plan, decision.phases.term) == ("split", "stall")
    assert decision.pull is not None and decision.pull.compute
    assert decision.pull.holder.worker_id == "p" and decision.prefill_s == 0
    assert decision.reasons["phase_plan"] == "split" and decision.reasons["pull_compute"] is True
    # the same prompt with no stream decoding on D: nothing to stall, D computes it
    idle = _fleet(("p", "prefill", 10_000), ("d", "decode", 2_000), decoding={})
    assert _decide(idle, 16_000, link_gbps=100).phases.term == "idle"
    # a looser objective: the stall is within it
    loose = _decide(fleet, 16_000, link_gbps=100, inter_token_objective_s=0.2)
    assert (loose.phases.plan, loose.phases.term) == ("aggregated", "gap")


def test_a_fast_prefill_worker_behind_a_slow_link_loses_to_local_prefill():
    # 16,000 tokens: P computes them in 0.16 s but sends them over 1 Gb/s in 9 s; D's own
    # prefill, stalls and all, is done in 8.6 s
    fleet = _fleet(("p", "prefill", 100_000), ("d", "decode", 2_000), decoding={"d": 4})
    slow = _decide(fleet, 16_000, link_gbps=1)
    assert slow.pull is None and (slow.phases.plan, slow.phases.term) == (
        "aggregated",
        "first_token",
    )
    fast = _decide(fleet, 16_000, link_gbps=100)
    assert fast.phases.plan == "split" and fast.pull is not None


def test_an_idle_both_worker_prefills_for_a_busy_one():
    """No worker of role "prefill": an idle "both" worker is P for the busy one a session's turn
    goes to (its session's worker while it has a free slot)."""
    fleet = _fleet(("busy", "both", 2_000), ("idle", "both", 10_000), decoding={"busy": 4})
    chooser = Chooser(RoutingSection(link_gbps=100))
    hashes = chain(list(range(16_000)))
    turns = (with_hashes(hashes, session=f"s{i}") for i in range(100))
    decision = next(
        d for t in turns if (d := chooser.choose(fleet, t)).workers[0].worker_id == "busy"
    )
    assert decision.phases.plan == "split" and decision.pull is not None
    assert decision.pull.holder.worker_id == "idle"
    # once the idle one decodes too, it lends nothing: no P
    idle = fleet.get("idle")
    assert idle is not None
    fleet.set_load(idle, common_pb2.Load(running=1))
    again = next(
        d
        for i in range(100)
        if (d := chooser.choose(fleet, with_hashes(hashes, session=f"s{i}"))).workers[0].worker_id
        == "busy"
    )
    assert (again.phases.plan, again.phases.term) == ("aggregated", "no_prefill_worker")


@pytest.mark.parametrize("objective", ["0", "-0.1"])
def test_an_objective_of_zero_or_below_is_a_config_error_naming_the_key(tmp_path, objective):
    path = tmp_path / "router.toml"
    path.write_text(f"[routing]\ninter_token_objective_s = {objective}\n")
    with pytest.raises(ConfigError) as error:
        load_config(RouterConfig, path, "infermesh_router", environ={})
    assert str(error.value).startswith(
        f"{path}: [routing]: inter_token_objective_s: must be positive"
    )


def test_the_baselines_rules_always_conditional_never():
    """``[routing] phase_split``'s baselines, for the benchmarks to compare against."""
    idle = _fleet(("p", "prefill", 10_000), ("d", "decode", 2_000), decoding={})
    always = _decide(idle, 16_000, link_gbps=100, phase_split="always")
    assert (always.phases.plan, always.phases.term) == ("split", "always")
    never = _decide(idle, 16_000, link_gbps=100, phase_split="never")
    assert (never.phases.plan, never.phases.term, never.pull) == ("aggregated", "never", None)
    # Dynamo's: 2,048 new tokens or more, and 0.7 of the prompt, on a P with nothing queued
    assert _decide(idle, 16_000, phase_split="conditional").phases.plan == "split"
    short = _decide(idle, 2_000, phase_split="conditional")
    assert (short.phases.plan, short.phases.term) == ("aggregated", "short")
    p = idle.get("p")
    assert p is not None
    idle.queued_prefill(p, 1.0)
    busy = _decide(idle, 16_000, phase_split="conditional")
    assert (busy.phases.plan, busy.phases.term) == ("aggregated", "busy_prefill")


def test_a_bad_phase_split_is_a_config_error_naming_the_key(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('[routing]\nphase_split = "sometimes"\n')
    expected = r"router.toml: \[routing\] phase_split: expected one of .*'sometimes'"
    with pytest.raises(ConfigError, match=expected):
        load_config(RouterConfig, path, "infermesh_router", environ={})


async def test_each_routed_request_is_counted_by_its_plan_and_deciding_term():
    """The router's counter, through a real router and a simulated worker: a request with block
    hashes, or with text alone (the router hashes it), on an idle worker is served aggregated as
    ``idle``; one the router cannot tokenize (its model's workers report no tokenizer) as
    ``unhashed``, and counted as such."""
    plans, unhashed = metrics.ROUTER_PHASE_PLANS, metrics.ROUTER_UNHASHED_ASKS
    async with (
        running_router() as router,
        running_worker(sim_engine(model="DeepSeek-V3", gpu="H200"), router, "w"),
    ):
        for hashed in (True, False):
            before = plans.labels("aggregated", "idle")._value.get()
            prompt = f"{hashed} " * 100  # not cached by the request before
            request = common_pb2.GenerateRequest(
                model=MODEL,
                prompt=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=1),
                prefix_hashes=chain(sim_token_ids(prompt_text(None, prompt))) if hashed else [],
            )
            await router.stub.Complete(request)
            assert plans.labels("aggregated", "idle")._value.get() - before == 1
        await register_unreachable_worker(router, model=_NO_TOKENIZER_MODEL)
        before, before_unhashed = (
            plans.labels("aggregated", "unhashed")._value.get(),
            unhashed._value.get(),
        )
        with pytest.raises(grpc.aio.AioRpcError):
            await router.stub.Complete(
                common_pb2.GenerateRequest(model=_NO_TOKENIZER_MODEL, prompt="hello " * 100)
            )
        assert plans.labels("aggregated", "unhashed")._value.get() - before == 1
        assert unhashed._value.get() - before_unhashed == 1
