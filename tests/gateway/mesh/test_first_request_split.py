"""No request routed blind: the gateway's first request, sent right after it starts, waits for
the model's tokenizer to load and carries its block hashes, so the router can split its phases
(prefill on P, decode on D) as for every later request."""

from __future__ import annotations

from router_svc.config import RoutingSection
from telemetry import metrics
from tests.helpers import MODEL
from tests.helpers.gateway import make_config, sdk, start_gateway
from tests.helpers.inprocess import running_router, running_worker, sim_engine

V3 = {"model": "DeepSeek-V3", "gpu": "H200"}


async def test_the_first_request_right_after_start_is_split(redis_server, api_key):
    # an idle D: the "always" rule splits every prompt a prefill worker can take
    async with (
        running_router(routing=RoutingSection(phase_split="always")) as router,
        running_worker(sim_engine(**V3), router, "p", role="prefill"),
        running_worker(sim_engine(**V3), router, "d", role="decode"),
    ):
        client = await start_gateway(make_config(redis_server.url, router.address))
        try:
            pulled = metrics.KV_PULL_BLOCKS.labels("p", "d")._value.get()
            async with sdk(client, api_key) as openai_client:
                answer = await openai_client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi " * 200}], max_tokens=2
                )
        finally:
            await client.close()
    assert answer.choices[0].message.content
    # P computed the prompt and D took its blocks: the request carried its hashes
    assert metrics.KV_PULL_BLOCKS.labels("p", "d")._value.get() - pulled > 0
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens > 0
