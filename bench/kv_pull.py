"""A cached prefix pulled from a peer against computing it (issue #35): the time to the first
token of an 8k-token prompt on a worker that takes its KV blocks from the peer holding them, the
time of the peer computing it, and the bytes a token's blocks take on the wire.

    nice -n 10 .venv/bin/python bench/kv_pull.py [--model-dir models/tiny-deepseek-v3-mla] \
        [--prompt-tokens 8192] [--repeats 3]

Two torch engines (worker_svc.torch_engine.Engine) on the tiny model with DeepSeek's MLA sizes
(kv_lora_rank 512, qk_rope_head_dim 64; 2 layers), in the dtype the precision policy picks here,
each served by a worker on loopback over the mesh's mutual TLS with a worker identity of its own
(``spiffe://infermesh/worker/p`` and ``/d``), in this process. Each repeat sends a fresh prompt
(--prompt-tokens token ids of the benchmark corpus, its first token its own), greedy, one new
token, as the gateway does (Worker.Serve), after one 1,024-token prompt on each engine to warm
it up: first to P, which computes it (recompute), then to D
with a KVPull naming P and the prompt's block hashes (pull: D pulls the blocks over Worker.KVBlocks,
takes them into its prefix cache, computes the last block); then the blocks alone are fetched
from P again (transfer); then another fresh prompt to D with a KVPull whose ``compute`` is set
(prefill on P, decode on D: D sends P the request, P computes the prompt and sends its blocks, D
computes the last block). Prints the median of each, the ratio recompute / pull (the issue's
target: >= 3), P/D's TTFT against recompute (what handing the prefill to P costs: the transfer
and D's last block), and the bytes per token received against the model's n_layers x
(kv_lora_rank + qk_rope_head_dim) x dtype size.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.mla_prefill import prompt_ids
from devtools.certs import role_tls, write_certs
from infermesh.pb import common_pb2, worker_pb2
from infermesh.prefix_hash import chain
from tests.helpers.worker_client import serving_as_worker, worker_client
from worker_svc.torch_engine.engine import Engine

_DEFAULT_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-deepseek-v3-mla"


async def run(args: argparse.Namespace) -> None:
    engines = [
        Engine.from_checkpoint(args.model_dir, max_model_len=args.prompt_tokens + 1024)
        for _ in "pd"
    ]
    p, d = engines
    model = p.model.args
    dtype = p.model.lm_head.weight.dtype
    computed = model.n_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * dtype.itemsize
    corpus = prompt_ids(p, args.prompt_tokens)
    recompute, pull, transfer, prefill_on_p, per_token = [], [], [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        certs = Path(workdir)
        write_certs(certs, workers={"p": [], "d": []})
        async with (
            serving_as_worker(p, "p", args.model_dir, certs) as p_address,
            serving_as_worker(d, "d", args.model_dir, certs) as d_address,
            worker_client(role_tls(certs, "gateway")) as gateway,
            worker_client(
                dataclasses.replace(
                    role_tls(certs, "worker"),
                    cert_file=str(certs / "worker-d.crt"),
                    key_file=str(certs / "worker-d.key"),
                )
            ) as peer,
        ):
            for address in (p_address, d_address):  # the first prefill pays for warming up
                warm_up = common_pb2.GenerateRequest(
                    request_id="warm-up",
                    model=args.model_dir.name,
                    prompt="(token ids)",
                    prompt_token_ids=corpus[:1024],
                    tokenizer=p.text_files.digest,
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1),
                )
                await gateway.complete(address, warm_up, timeout_s=3600)
            for repeat in range(args.repeats):
                ids = [7 + repeat, *corpus[1:]]
                request = common_pb2.GenerateRequest(
                    request_id=f"pull-{repeat}",
                    model=args.model_dir.name,
                    prompt="(token ids)",
                    prompt_token_ids=ids,
                    tokenizer=p.text_files.digest,
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1),
                )
                hashes = chain(ids)
                start = time.perf_counter()
                computed_answer = await gateway.complete(p_address, request, timeout_s=3600)
                recompute.append(time.perf_counter() - start)
                kv_pull = common_pb2.KVPull(
                    worker_id="p", address=p_address, prefix_hashes=hashes, timeout_ms=3_600_000
                )
                start = time.perf_counter()
                pulled = await gateway.complete(d_address, request, timeout_s=3600, pull=kv_pull)
                pull.append(time.perf_counter() - start)
                assert list(pulled.token_ids) == list(computed_answer.token_ids), "not exact"
                assert pulled.usage.cached_prompt_tokens >= len(ids) - 16, "nothing pulled"
                start = time.perf_counter()
                received = 0
                async for message in peer.stub(p_address).KVBlocks(
                    worker_pb2.KVBlocksRequest(prefix_hashes=hashes)
                ):
                    received += sum(len(t.data) for b in message.blocks for t in b.tensors)
                transfer.append(time.perf_counter() - start)
                per_token.append(received / (len(hashes) * 16))
                # prefill on P, decode on D: a prompt neither holds
                fresh = [10_000 + repeat, *corpus[1:]]
                request.request_id, request.prompt_token_ids[:] = f"pd-{repeat}", fresh
                pd = common_pb2.KVPull(
                    worker_id="p",
                    address=p_address,
                    prefix_hashes=chain(fresh),
                    timeout_ms=3_600_000,
                    compute=True,
                )
                start = time.perf_counter()
                disaggregated = await gateway.complete(d_address, request, timeout_s=3600, pull=pd)
                prefill_on_p.append(time.perf_counter() - start)
                assert disaggregated.usage.cached_prompt_tokens >= len(fresh) - 16, "not P/D"
                print(
                    f"repeat {repeat}: recompute {recompute[-1]:.2f} s, pull {pull[-1]:.3f} s, "
                    f"transfer {transfer[-1]:.3f} s ({received / 2**20:.1f} MiB), "
                    f"prefill on P {prefill_on_p[-1]:.2f} s",
                    flush=True,
                )
    for engine in engines:
        await engine.close()
    r, q, t, pd_s = (statistics.median(x) for x in (recompute, pull, transfer, prefill_on_p))
    print(
        f"{args.prompt_tokens} tokens, {dtype}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"recompute (P's TTFT):              {r:8.3f} s")
    print(f"pull (D's TTFT, pulled from P):    {q:8.3f} s   recompute / pull = {r / q:.1f}x")
    print(f"prefill on P, decode on D (TTFT):  {pd_s:8.3f} s   P/D / recompute = {pd_s / r:.2f}x")
    print(
        f"transfer alone (Worker.KVBlocks):  {t:8.3f} s   "
        f"{statistics.median(per_token) * args.prompt_tokens / t / 2**30:.2f} GiB/s"
    )
    print(
        f"bytes per token: {statistics.median(per_token):.0f} received, {computed} from the "
        f"model ({model.n_layers} layers x ({model.kv_lora_rank} + {model.qk_rope_head_dim}) x "
        f"{dtype.itemsize} B)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=_DEFAULT_DIR)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
