"""The routed experts as two grouped launches (worker_svc/model/fused_moe.py, triton_moe.py), run by
Triton's interpreter on a CPU against the model's per-expert eager loop, and the dispatch's promise
that it never waits on the host."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.host_sync import HostSyncError, NoHostSync
from tests.helpers.triton_interpreter import TritonInterpreter
from worker_svc.model.checkpoint import load_checkpoint
from worker_svc.model.fused_moe import combine, route
from worker_svc.model.kernel import FP8, pad_to_blocks, weight_quant
from worker_svc.model.model import Linear, ModelArgs, MoE
from worker_svc.torch_engine.cuda_graphs import DecodeGraphs, DecodeInputs

# K = 256 (two 128-blocks), I = 192 (a partial last block of the gate/up columns, and the down
# projection's K padded from 192 to 256 in FP8), 4 experts, 2 a token
_ARGS = ModelArgs(
    dim=256,
    moe_inter_dim=192,
    n_routed_experts=4,
    n_activated_experts=2,
    n_expert_groups=1,
    n_limited_groups=1,
)
# the largest decode batch the engine captures by default ([engine] cuda_graph_batch_sizes)
_BIGGEST_BUCKET = 64


def _moe(fp8: bool, dtype: torch.dtype, seed: int = 0) -> MoE:
    """The model's MoE layer with random experts: FP8 block-quantized as a checkpoint stores them,
    or in `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        moe = MoE(_ARGS)
    with torch.no_grad():
        for linear in moe.modules():
            if not isinstance(linear, Linear):
                continue
            shape = (linear.out_features, linear.in_features)
            weight = torch.randn(shape, generator=generator) / linear.in_features**0.5
            if fp8:
                linear.hold_fp8()
                q, scale = weight_quant(weight)
                linear.weight.copy_(pad_to_blocks(q))
                assert linear.weight_scale_inv is not None
                linear.weight_scale_inv.copy_(scale)
            else:
                linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    return moe


def _uneven_choice(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert 0 in nearly every token, 1 and 3 in some, expert 2 in none: uneven counts, one expert
    with zero rows."""
    generator = torch.Generator().manual_seed(tokens)
    first = torch.zeros(tokens, dtype=torch.long)
    first[tokens - tokens // 8 :] = 3
    second = torch.where(torch.rand(tokens, generator=generator) < 0.7, 1, 3)
    second[tokens - tokens // 8 :] = 1
    weights = torch.rand(tokens, 2, generator=generator)
    return weights, torch.stack([first, second], dim=1)


def _grouped(
    moe: MoE, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """In the interpreter's process: the experts stacked, the grouped path run (dispatch, both
    launches, the sum) under the host-sync check."""
    moe.stack_experts()
    assert moe.grouped is not None
    with NoHostSync():
        return moe.grouped(x, weights, indices)


@pytest.mark.parametrize(
    ("fp8", "dtype", "tokens"),
    [
        (True, torch.float32, 7),
        (True, torch.bfloat16, _BIGGEST_BUCKET),
        (False, torch.bfloat16, 7),
    ],
)
def test_grouped_experts_match_the_per_expert_reference(
    interpreter: TritonInterpreter, fp8: bool, dtype: torch.dtype, tokens: int
) -> None:
    """The same quantized rows, FP8 products summed in FP32: only summation order differs (a float32
    model: 1e-5 of the largest output; BF16 outputs round the same sums to the same bits, or one
    BF16 ulp off where SiLU's exp differs). It runs without a host synchronisation."""
    moe = _moe(fp8, dtype)
    weights, indices = _uneven_choice(tokens)
    x = torch.randn(tokens, _ARGS.dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights = weights.to(dtype)
    expected = moe._per_expert(x, weights, indices)
    got = interpreter.call(_grouped, moe, x, weights, indices)
    assert got.shape == expected.shape and got.dtype == dtype
    scale = float(expected.float().abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(
            got.float(), expected.float(), rtol=2.0**-7, atol=2.0**-8 * scale
        )


def test_the_dispatch_runs_without_data_on_the_meta_device() -> None:
    """On the meta device any read of data fails (.item(), .tolist(), a copy to the CPU): the
    dispatch and the sum compute only from shapes."""
    weights = torch.empty(64, 8, device="meta")
    indices = torch.empty(64, 8, dtype=torch.long, device="meta")
    routing = route(weights, indices, 256)
    assert routing.offsets.shape == (257,) and routing.source.shape == (512,)
    assert combine(torch.empty(512, 32, device="meta"), routing, 8).shape == (64, 32)


def test_route_sorts_the_pairs_by_expert() -> None:
    weights, indices = _uneven_choice(16)
    with NoHostSync():
        routing = route(weights, indices, 4)
    counts = torch.bincount(indices.flatten(), minlength=4)
    assert routing.offsets.tolist() == [0, *counts.cumsum(0).tolist()]
    assert counts[2] == 0  # the expert with no rows
    flat = indices.flatten()
    experts = flat.argsort(stable=True)
    assert torch.equal(routing.source, experts // 2)
    assert torch.equal(routing.weights, weights.flatten()[experts])
    assert torch.equal(experts[routing.inverse], torch.arange(32))


def test_the_check_catches_a_host_read() -> None:
    """What the check is for: a made-up `.item()` after the dispatch, and the per-expert loop (its
    counts read on the host) fail it; `.tolist()` fails on the meta device."""
    weights, indices = _uneven_choice(16)
    with NoHostSync(), pytest.raises(HostSyncError, match="_local_scalar_dense"):
        int(route(weights, indices, 4).offsets[-1].item())
    moe = _moe(False, torch.float32)
    with NoHostSync(), pytest.raises(HostSyncError, match="bincount"):
        moe._per_expert(torch.randn(16, _ARGS.dim), weights, indices)
    routing = route(weights.to("meta"), indices.to("meta"), 4)
    with pytest.raises(NotImplementedError, match="meta"):
        routing.offsets.tolist()


def _capture_checking_host_sync(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A capture stand-in that runs the step once under the check, as a CUDA graph's capture would
    refuse a host synchronisation; its "replay" hands back that run's output (only the capture is
    under test here)."""
    with NoHostSync():
        out = step()
    return lambda: out


def _decode_step_without_host_sync(model_dir: Path) -> torch.Tensor:
    """In the interpreter's process: the tiny V3 served in FP8 as on a GPU (its experts grouped,
    every other projection through the Triton GEMM) runs the engine's capturable decode step at
    batch 2 under the check."""
    model, _ = load_checkpoint(model_dir, FP8, "cpu")
    for module in model.modules():
        if isinstance(module, Linear):
            module.fp8_gemm = "triton"
    cache = model.setup_cache(2, 16)
    graphs = DecodeGraphs(model, cache, [2], scratch_block=1, capture=_capture_checking_host_sync)
    inputs = DecodeInputs(
        tokens=torch.tensor([3, 5]),
        positions=torch.tensor([0, 0]),
        write_slots=torch.tensor([0, 16]),
        key_slots=torch.tensor([[0] * 256, [16] * 256]),
    )
    logits = graphs.run((2, 256), inputs)
    assert logits is not None
    return logits


def test_the_decode_step_with_grouped_experts_never_waits_on_the_host(
    interpreter: TritonInterpreter, tiny_dir: Path
) -> None:
    """The whole step a CUDA graph captures (embedding, MLA decode, the FP8 projections, the gate,
    the grouped experts, lm_head) under the check: what a capture on a GPU would refuse fails here
    first."""
    logits = interpreter.call(_decode_step_without_host_sync, tiny_dir)
    assert logits.shape == (2, 16393) and bool(logits.isfinite().all())


def _loaded(model_dir: Path, grouped_moe: bool) -> tuple[list[bool], torch.Tensor]:
    """(which MoE layers run grouped, the last logits of an 8-token prompt) of the checkpoint as
    the engine loads it, in the interpreter's process."""
    model, _ = load_checkpoint(model_dir, torch.float32, "cpu", grouped_moe=grouped_moe)
    grouped = [
        layer.mlp.grouped is not None for layer in model.layers if isinstance(layer.mlp, MoE)
    ]
    return grouped, model(torch.arange(5, 13).unsqueeze(0), 0, model.setup_cache(1, 8))


def test_the_loader_stacks_the_experts_where_the_kernel_runs(
    interpreter: TritonInterpreter, tiny_dir: Path
) -> None:
    """The tiny V3 (hidden 320, experts of 192, float32) loaded where the grouped kernel runs: its
    MoE layer runs grouped and gives the per-expert model's logits; `[engine] grouped_moe = false`
    keeps the loop."""
    grouped, logits = interpreter.call(_loaded, tiny_dir, True)
    assert grouped == [True]
    assert interpreter.call(_loaded, tiny_dir, False)[0] == [False]
    reference, _ = load_checkpoint(tiny_dir, torch.float32, "cpu")
    expected = reference(torch.arange(5, 13).unsqueeze(0), 0, reference.setup_cache(1, 8))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
