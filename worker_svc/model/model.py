"""DeepSeek-V3, V3.2 and V2 (model_type deepseek_v3, deepseek_v32, deepseek_v2) forward pass in
plain PyTorch.

MLA attention with a compressed latent KV cache: decode attends over the latents with kv_b_proj
absorbed into the query and the output (DeepSeek's "absorb" mode), a prefill chunk over keys and
values expanded from them (DeepSeek's "naive" mode, as its inference code and vLLM prefill). MoE
with shared experts and the router config.json names (V3: sigmoid scores, bias-steered
group-limited top-k; V2: softmax scores, greedy or group-limited greedy top-k), YaRN RoPE; V3.2
adds DeepSeek Sparse Attention: per layer an `Indexer` picks the tokens MLA attends to
(worker_svc.model.indexer). Module and parameter names follow the HF checkpoint
(`self_attn.q_a_proj`, ...) so a state dict loads by name; classes carry the paper's words (MLA,
Gate, Expert, MoE, Block).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.model.fused_moe import GroupedExperts
from worker_svc.model.indexer import (
    hadamard_rotate,
    select_tokens,
    select_tokens_fp8,
    sparse_attend,
)
from worker_svc.model.kernel import BLOCK_SIZE, FP8, GemmImpl, block_scale_shape, fp8_linear
from worker_svc.model.paged_batch import AttentionGroup, BatchLayout, KVCache

# The routers this engine runs (config.json's scoring_func and topk_method): V3's sigmoid scores
# with a selection bias and group-limited top-k ("noaux_tc"); V2's softmax scores, top-k over all
# experts ("greedy") or within the best groups by their best expert ("group_limited_greedy").
SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass
class ModelArgs:
    """Hyper-parameters of a DeepSeek-V3 or V2 model, built from config.json by
    `model_config.model_args`.

    dim/inter_dim/moe_inter_dim: hidden, dense-MLP and per-expert MLP widths.
    n_layers: decoder layers (MTP layers stored past them are not part of the model).
    n_dense_layers: the first layers use a dense MLP instead of MoE (first_k_dense_replace); past
    them every moe_layer_freq-th layer is MoE, the others dense.
    q_lora_rank: rank of the query compression; 0 means a plain q_proj.
    kv_lora_rank: width of the cached latent; qk_rope_head_dim: the rope'd key part, shared by
    heads. n_expert_groups/n_limited_groups: experts are chosen only inside the top
    `n_limited_groups` groups (n_group/topk_group); route_scale multiplies the (normalised if
    norm_topk_prob) routing weights. scoring_func/topk_method: the router's scores and expert
    choice, one of SCORING_FUNCS / TOPK_METHODS.
    rope_factor/original_seq_len/beta_*/mscale*/rope_attention_factor/rope_truncate: YaRN (rope_type
    "yarn"). index_topk/index_n_heads/index_head_dim: DeepSeek Sparse Attention (V3.2): each query
    attends to the `index_topk` earlier tokens its lightning indexer scores highest; index_topk 0
    means dense attention (V3).
    """

    vocab_size: int = 129280
    dim: int = 7168
    inter_dim: int = 18432
    n_layers: int = 61
    n_heads: int = 128
    max_seq_len: int = 4096
    rms_norm_eps: float = 1e-6
    # mla
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # moe
    moe_inter_dim: int = 2048
    n_dense_layers: int = 3
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8
    n_expert_groups: int = 8
    n_limited_groups: int = 4
    norm_topk_prob: bool = True
    route_scale: float = 2.5
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1
    # rope: "default" or "yarn"
    rope_type: str = "default"
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    rope_attention_factor: float | None = None  # None: from the mscales
    rope_truncate: bool = True  # round the correction range to whole dimensions
    # dsa
    index_topk: int = 0
    index_n_heads: int = 64
    index_head_dim: int = 128

    def __post_init__(self) -> None:
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        assert self.n_routed_experts % self.n_expert_groups == 0, f"n_group={self.n_expert_groups}"
        assert self.scoring_func in SCORING_FUNCS and self.topk_method in TOPK_METHODS, (
            self.scoring_func,
            self.topk_method,
        )
        assert self.moe_layer_freq >= 1, f"moe_layer_freq={self.moe_layer_freq}"

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers and layer_id % self.moe_layer_freq == 0

    @property
    def sparse(self) -> bool:
        """True for a V3.2 model: MLA attends only to the tokens its indexer selects."""
        return self.index_topk > 0


# ---------------------------------------------------------------------------------------- rope


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def precompute_freqs_cis(args: ModelArgs) -> torch.Tensor:
    """Complex rotations for every position: [max_seq_len, qk_rope_head_dim // 2], scaled by the
    attention factor."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    attention_factor = 1.0
    if args.rope_type == "yarn":
        freqs, attention_factor = yarn_freqs(args, freqs)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.polar(torch.full_like(angles, attention_factor), angles)


def yarn_freqs(args: ModelArgs, freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN as transformers computes it: interpolated frequencies (divided by the factor) blended
    into the original ones across the correction range, and the cos/sin scale: rope_attention_factor
    if given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    dim, base, factor = args.qk_rope_head_dim, args.rope_theta, args.rope_factor

    def correction_dim(num_rotations: float) -> float:
        return (
            dim
            * math.log(args.original_seq_len / (num_rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(args.beta_fast), correction_dim(args.beta_slow)
    if args.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    freqs = freqs / factor * ramp + freqs * (1 - ramp)
    if args.rope_attention_factor is not None:
        return freqs, args.rope_attention_factor
    if args.mscale and args.mscale_all_dim:
        return freqs, yarn_get_mscale(factor, args.mscale) / yarn_get_mscale(
            factor, args.mscale_all_dim
        )
    return freqs, yarn_get_mscale(factor)


def apply_rotary_emb(
    x: torch.Tensor, freqs_cis: torch.Tensor, interleaved: bool = True
) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x: [T, H, rope_dim]; freqs_cis: [T,
    rope_dim/2].

    HF's `apply_rotary_pos_emb_interleave` returns the same pairs de-interleaved ([evens, odds]);
    both q and k get one layout, so every q.k dot product is identical. `interleaved=False` rotates
    the pairs (x_i, x_{i + rope_dim/2}) instead (HF's rotate_half), as V3.2's indexer does.
    """
    dtype = x.dtype
    if interleaved:
        xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        return torch.view_as_real(xc * freqs_cis.unsqueeze(-2)).flatten(-2).to(dtype)
    xc = torch.view_as_complex(x.float().unflatten(-1, (2, -1)).transpose(-1, -2).contiguous())
    return torch.view_as_real(xc * freqs_cis.unsqueeze(-2)).transpose(-1, -2).flatten(-2).to(dtype)


# ------------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.size(-1),), eps=self.eps).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 (the indexer's k_norm), returned in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.float(), self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class Linear(nn.Linear):
    """A bias-free linear layer; its weight is in the compute dtype, or FP8 E4M3 as the checkpoint
    stores it.

    In FP8 (after `hold_fp8`) it keeps a float32 `weight_scale_inv` per 128x128 block and runs
    act_quant -> fp8_gemm (kernel.fp8_linear): about one byte per weight instead of two or four.
    `fp8_gemm` picks the GEMM's implementation (kernel.GemmImpl; bench/hopper_suite.py compares
    them in the whole model).
    """

    fp8_gemm: GemmImpl = "auto"

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.weight_scale_inv: torch.Tensor | None
        self.register_buffer("weight_scale_inv", None)

    def hold_fp8(self) -> None:
        """Before loading: this layer will hold an FP8 weight (K padded to whole blocks) and its
        block scales."""
        out_features, k_padded = self.out_features, -(-self.in_features // BLOCK_SIZE) * BLOCK_SIZE
        device = self.weight.device
        self.weight = nn.Parameter(
            torch.empty(out_features, k_padded, dtype=FP8, device=device), requires_grad=False
        )
        scale_shape = block_scale_shape((out_features, k_padded))
        self.weight_scale_inv = torch.empty(scale_shape, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return dense_linear(x, self.weight)
        return fp8_linear(x, self.weight, self.weight_scale_inv, impl=self.fp8_gemm)


# dense_linear on a CPU: the weight-left GEMM under this many tokens (decode)
_WEIGHT_LEFT_UNDER_ROWS = 64
_OUT_CHUNK = 4096  # output features per GEMM there: each chunk's transposing copy stays in cache


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T; x: [T, in], weight: [out, in].

    In float32 on a CPU, for fewer than 64 tokens it runs as weight @ x.T over at least two columns:
    MKL streams a weight fastest as the left operand of a GEMM, while its GEMV (one token) and its
    x @ W.T at a few tokens read it 1.5-3x slower (docs/benchmarks/worker-throughput.md). From 64
    tokens on (prefill) x @ W.T is as fast or faster.
    """
    rows = x.size(0)
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or rows >= _WEIGHT_LEFT_UNDER_ROWS
    ):
        return F.linear(x, weight)
    columns = (x if rows > 1 else torch.cat((x, x))).t()  # [in, max(T, 2)]
    out = x.new_empty(rows, weight.size(0))
    for start in range(0, weight.size(0), _OUT_CHUNK):
        part = weight[start : start + _OUT_CHUNK]
        out[:, start : start + part.size(0)] = torch.mm(part, columns)[:, :rows].t()
    return out


def stack_linears(linears: list[Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [len(linears), out_features, in_features] weight (and FP8 block scales) for Linears of
    one shape, e.g. every expert's gate_proj; each Linear keeps a view into it, as in
    pack_linears."""
    weight = torch.stack([linear.weight for linear in linears])
    scales = [linear.weight_scale_inv for linear in linears]
    scale = None if scales[0] is None else torch.stack(cast(list[torch.Tensor], scales))
    for i, linear in enumerate(linears):
        linear.weight = nn.Parameter(weight[i], requires_grad=False)
        if scale is not None:
            linear.weight_scale_inv = scale[i]
    return weight, scale


def _linear(in_features: int, out_features: int) -> Linear:
    return Linear(in_features, out_features)


def pack_linears(linears: list[Linear]) -> torch.Tensor | None:
    """One [sum of out_features, in_features] weight for Linears that read the same input, or None
    if one holds FP8.

    Each Linear keeps a view into it, so its own forward, state_dict() and the checkpoint names are
    unchanged.
    """
    if any(linear.weight_scale_inv is not None for linear in linears):
        return None
    packed = torch.cat([linear.weight for linear in linears])
    for linear, weight in zip(
        linears, packed.split([linear.out_features for linear in linears]), strict=True
    ):
        linear.weight = nn.Parameter(weight, requires_grad=False)
    return packed


class Indexer(nn.Module):
    """V3.2's lightning indexer: picks, for every query, the index_topk tokens MLA attends to
    (worker_svc.model.indexer)."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        self.wq_b = _linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim)
        self.wk = _linear(args.dim, args.index_head_dim)
        self.k_norm = LayerNorm(args.index_head_dim, eps=1e-6)
        # served in float32, as HF keeps it
        self.weights_proj = nn.Linear(args.dim, args.index_n_heads, bias=False)
        self.softmax_scale = args.index_head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        layout: BatchLayout,
        freqs_cis: torch.Tensor,
        cache: KVCache,
    ) -> list[torch.Tensor | None]:
        """Caches each token's indexer key -> per attention group, [b, s, index_topk] selected
        positions, or None where no query sees more than index_topk tokens (so all of them are
        selected)."""
        a = self.args
        q = self.wq_b(q_latent).unflatten(-1, (a.index_n_heads, a.index_head_dim))  # [T, Hi, D]
        q = self._rope(q, freqs_cis)
        k = self._rope(self.k_norm(self.wk(x)).unsqueeze(1), freqs_cis).squeeze(1)  # [T, D]
        fp8 = self.wq_b.weight_scale_inv is not None
        # served in FP8 (sm90): DeepSeek's FP8 scoring, of rotated q and k (the cache holds rotated
        # keys)
        if fp8:
            q, k = hadamard_rotate(q), hadamard_rotate(k)
        if cache.index_k is None:
            raise ValueError("a sparse-attention layer needs a cache with indexer keys")
        keys = cache.index_k[self.layer_id]
        keys.index_copy_(0, layout.write_slots, k)
        # [T, Hi]
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * a.index_n_heads**-0.5
        select = select_tokens_fp8 if fp8 else select_tokens
        selections: list[torch.Tensor | None] = []
        for group in layout.groups:
            if group.key_slots.size(1) <= a.index_topk:
                selections.append(None)
                continue
            end = group.token_start + group.batch * group.seqlen
            shape = (group.batch, group.seqlen)
            selections.append(
                select(
                    q[group.token_start : end].unflatten(0, shape),
                    weights[group.token_start : end].unflatten(0, shape),
                    keys[group.key_slots],
                    group.mask,
                    a.index_topk,
                    self.softmax_scale,
                )
            )
        return selections

    def _rope(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """Non-interleaved RoPE on the leading qk_rope_head_dim features of x: [T, H,
        index_head_dim]."""
        rope, rest = x.split(
            [self.args.qk_rope_head_dim, self.args.index_head_dim - self.args.qk_rope_head_dim], -1
        )
        return torch.cat([apply_rotary_emb(rope, freqs_cis, interleaved=False), rest], dim=-1)


# queries of a prefill chunk that attend together in the expanded form: their scores stay bounded
_QUERY_CHUNK = 1024


class MLA(nn.Module):
    """Multi-head Latent Attention. Decode attends over the latent cache without expanding it; a
    prefill chunk expands the latents it reads (and, on V3.2, attends absorbed where its indexer
    selects tokens: the selection differs per query)."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        self.n_heads = args.n_heads
        if args.q_lora_rank:
            self.q_a_proj = _linear(args.dim, args.q_lora_rank)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = _linear(args.q_lora_rank, args.n_heads * args.qk_head_dim)
        else:
            self.q_proj = _linear(args.dim, args.n_heads * args.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = _linear(
            args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
        )
        self.o_proj = _linear(args.n_heads * args.v_head_dim, args.dim)
        self.softmax_scale = args.qk_head_dim**-0.5
        if args.rope_factor > 1 and args.mscale_all_dim:
            self.softmax_scale *= yarn_get_mscale(args.rope_factor, args.mscale_all_dim) ** 2
        # set by pack(): the two projections of x as one GEMM
        self.wq_kv_a: torch.Tensor | None = None
        self.indexer = Indexer(args, layer_id) if args.sparse else None
        # prefill chunks attend in the absorbed form too (Transformer.absorb_prefill)
        self.absorb_prefill = False
        assert args.qk_head_dim <= args.qk_nope_head_dim + args.v_head_dim, (
            f"the expanded prefill reads values {args.qk_head_dim} wide out of kv_b_proj's "
            f"{args.qk_nope_head_dim + args.v_head_dim} features per head"
        )

    def pack(self) -> None:
        self.wq_kv_a = pack_linears([self._first_q_proj, self.kv_a_proj_with_mqa])

    @property
    def _first_q_proj(self) -> Linear:
        return self.q_a_proj if self.args.q_lora_rank else self.q_proj

    def _query_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, dim] -> (queries [T, H * qk_head_dim], latent and k_pe [T, kv_lora_rank +
        qk_rope_head_dim], the query latent q_a_layernorm(q_a_proj(x)) that V3.2's indexer reads; x
        itself without q_lora_rank)."""
        q_proj, kv_proj = self._first_q_proj, self.kv_a_proj_with_mqa
        if self.wq_kv_a is None:
            q, kv = q_proj(x), kv_proj(x)
        else:
            q, kv = dense_linear(x, self.wq_kv_a).split(
                [q_proj.out_features, kv_proj.out_features], dim=-1
            )
        if self.args.q_lora_rank:
            q_latent = self.q_a_layernorm(q)
            return self.q_b_proj(q_latent), kv, q_latent
        return q, kv, x

    def forward(
        self, x: torch.Tensor, layout: BatchLayout, freqs_cis: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """x: [T, dim], the step's tokens of all sequences packed; freqs_cis: [T, r/2] at their
        positions."""
        a = self.args
        q, kv, q_latent = self._query_and_latent(x)
        q_nope, q_pe = torch.split(
            q.unflatten(-1, (self.n_heads, a.qk_head_dim)),
            [a.qk_nope_head_dim, a.qk_rope_head_dim],
            dim=-1,
        )
        q_pe = apply_rotary_emb(q_pe, freqs_cis)  # [T, H, r]
        kv, k_pe = torch.split(kv, [a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(1), freqs_cis).squeeze(1)  # [T, r]
        layer_cache = cache.kv[self.layer_id]  # [slots, c + r]
        layer_cache.index_copy_(
            0, layout.write_slots, torch.cat([self.kv_a_layernorm(kv), k_pe], dim=-1)
        )

        chosen = (
            [None] * len(layout.groups)
            if self.indexer is None
            else self.indexer(x, q_latent, layout, freqs_cis, cache)
        )
        # [T, H, d_v]
        out = torch.cat(
            [
                self._attend_expanded(q_nope, q_pe, g, layer_cache)
                if g.seqlen > 1 and c is None and not self.absorb_prefill
                else self._attend_absorbed(q_nope, q_pe, g, layer_cache, c)
                for g, c in zip(layout.groups, chosen, strict=True)
            ]
        )
        return self.o_proj(out.flatten(1))

    def _attend_absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        group: AttentionGroup,
        layer_cache: torch.Tensor,
        selected: torch.Tensor | None,
    ) -> torch.Tensor:
        """The group's queries with kv_b_proj absorbed: q_nope -> latent space (one dot product
        with [latent, k_pe] scores both parts), the latent output -> v. -> [b * s, H, d_v]"""
        a = self.args
        wkv_b = self.kv_b_proj.weight.view(self.n_heads, -1, a.kv_lora_rank)  # [H, d_nope + d_v, c]
        rows = slice(group.token_start, group.token_start + group.batch * group.seqlen)
        q_nope = torch.einsum("thd,hdc->thc", q_nope[rows], wkv_b[:, : a.qk_nope_head_dim])
        # [b, s, H, c + r]
        q = torch.cat([q_nope, q_pe[rows]], dim=-1).unflatten(0, (group.batch, group.seqlen))
        out = self._attend_latent(q, group, layer_cache, selected)  # [b * s, H, c]
        return torch.einsum("thc,hdc->thd", out, wkv_b[:, a.qk_nope_head_dim :])

    def _attend_latent(
        self,
        q: torch.Tensor,
        group: AttentionGroup,
        layer_cache: torch.Tensor,
        selected: torch.Tensor | None,
    ) -> torch.Tensor:
        """The group's absorbed queries q: [b, s, H, c + r] over its sequences' cached latents (only
        the `selected` ones, where the indexer chose) -> latent outputs [b * s, H, c]."""
        if selected is not None:
            out = sparse_attend(
                q,
                layer_cache,
                group.key_slots,
                group.mask,
                selected,
                self.softmax_scale,
                self.args.kv_lora_rank,
            )
            return out.flatten(0, 1)
        keys = layer_cache[group.key_slots]  # [b, L, c + r]
        scores = torch.einsum(
            "bshc,btc->bsht", q, keys
        ) * self.softmax_scale + group.mask.unsqueeze(2)
        probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q)
        return torch.einsum("bsht,btc->bshc", probs, keys[..., : self.args.kv_lora_rank]).flatten(
            0, 1
        )

    def _attend_expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        group: AttentionGroup,
        layer_cache: torch.Tensor,
    ) -> torch.Tensor:
        """A prefill group's queries over keys and values expanded from its cached latents by
        kv_b_proj (prefix included), per head qk_head_dim wide keys and v_head_dim wide values: for
        many queries far fewer operations than the absorbed form's kv_lora_rank-wide ones. Queries
        go in chunks of _QUERY_CHUNK, each over the keys up to its last position only, so the
        masked half of causal attention is skipped and memory stays bounded. -> [b * s, H, d_v]"""
        a = self.args
        end = group.token_start + group.batch * group.seqlen
        # [b, H, s, qk_head_dim]
        q = torch.cat([q_nope[group.token_start : end], q_pe[group.token_start : end]], dim=-1)
        q = q.unflatten(0, (group.batch, group.seqlen)).transpose(1, 2)
        latent, k_pe = layer_cache[group.key_slots].split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(latent.flatten(0, 1)).unflatten(0, latent.shape[:2])
        kv = kv.unflatten(-1, (self.n_heads, -1))  # [b, L, H, d_nope + d_v]
        k_nope = kv[..., : a.qk_nope_head_dim]
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.n_heads, -1)], dim=-1)
        # torch's fused (flash) attention wants values as wide as keys: the qk_head_dim features
        # that end with v (a view, no copy), of whose outputs only v's are kept
        v = kv[..., -a.qk_head_dim :]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, H, L, qk_head_dim]
        key_positions = torch.arange(group.key_slots.size(1), device=q.device)
        out = []
        for start in range(0, group.seqlen, _QUERY_CHUNK):
            query_positions = group.query_positions[:, start : start + _QUERY_CHUNK]  # [b, chunk]
            keys = int(query_positions[:, -1].max()) + 1  # none later is visible to the chunk
            # [b, 1, chunk, keys]: shared by the heads
            visible = (key_positions[:keys] <= query_positions.unsqueeze(-1)).unsqueeze(1)
            out.append(
                F.scaled_dot_product_attention(
                    q[:, :, start : start + _QUERY_CHUNK],
                    k[:, :, :keys],
                    v[:, :, :keys],
                    attn_mask=visible,
                    scale=self.softmax_scale,
                )[..., -a.v_head_dim :]
            )
        return torch.cat(out, dim=2).transpose(1, 2).flatten(0, 1)


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense layers, each routed expert and the shared experts."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.gate_proj = _linear(dim, inter_dim)
        self.up_proj = _linear(dim, inter_dim)
        self.down_proj = _linear(inter_dim, dim)
        self.gate_up: torch.Tensor | None = None  # set by pack(): gate_proj and up_proj as one GEMM

    def pack(self) -> None:
        self.gate_up = pack_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = dense_linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


Expert = MLP


def _top2_sum(grouped: torch.Tensor) -> torch.Tensor:
    return grouped.topk(2, dim=-1)[0].sum(dim=-1)


def _best(grouped: torch.Tensor) -> torch.Tensor:
    return grouped.amax(dim=-1)


_SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "softmax": functools.partial(torch.softmax, dim=-1),
}
# how a group of experts is ranked (noaux_tc: its two best biased scores; V2: its best score);
# greedy: no groups
_GROUP_SCORES = {"noaux_tc": _top2_sum, "group_limited_greedy": _best}


class Gate(nn.Module):
    """Router: scores each expert (sigmoid or softmax), keeps the top-k, optionally only inside the
    best groups.

    noaux_tc (V3) holds `e_score_correction_bias`: it steers the choice, the weights are the
    unbiased scores. norm_topk_prob rescales the chosen weights to sum to 1 before route_scale, as
    vLLM does for both families; transformers' DeepseekV2 ignores the key, and every DeepSeek-V2
    checkpoint sets it false.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(
            torch.empty(args.n_routed_experts, args.dim, dtype=torch.float32)
        )
        bias = (
            torch.zeros(args.n_routed_experts, dtype=torch.float32)
            if args.topk_method == "noaux_tc"
            else None
        )
        self.e_score_correction_bias: torch.Tensor | None
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, dim] -> (weights [T, k] in x's dtype, expert indices [T, k])."""
        a = self.args
        scores = _SCORES[a.scoring_func](F.linear(x.float(), self.weight.float()))  # [T, E]
        choice = (
            scores
            if self.e_score_correction_bias is None
            else scores + self.e_score_correction_bias
        )
        if a.topk_method in _GROUP_SCORES and a.n_expert_groups > 1:
            grouped = choice.view(x.size(0), a.n_expert_groups, -1)  # [T, G, E/G]
            # [T, g]
            top_groups = _GROUP_SCORES[a.topk_method](grouped).topk(a.n_limited_groups, dim=-1)[1]
            keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(
                1, top_groups, True
            )
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        indices = choice.topk(a.n_activated_experts, dim=-1)[1]
        weights = scores.gather(1, indices)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * a.route_scale).type_as(x), indices


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Gate(args)
        self.experts = nn.ModuleList(
            Expert(args.dim, args.moe_inter_dim) for _ in range(args.n_routed_experts)
        )
        self.shared_experts = MLP(args.dim, args.n_shared_experts * args.moe_inter_dim)
        # set by stack_experts(): the routed experts as two grouped launches
        self.grouped: GroupedExperts | None = None

    @torch.no_grad()
    def stack_experts(self) -> None:
        """After loading, where fused_moe's grouped kernel runs: each projection of every expert
        as one stacked tensor (the experts' Linears keep views), so a batch's routed experts are
        two launches and a dispatch without host synchronisation (a CUDA graph captures it)."""
        experts = cast(list[MLP], list(self.experts))
        gate, gate_scale = stack_linears([e.gate_proj for e in experts])
        up, up_scale = stack_linears([e.up_proj for e in experts])
        down, down_scale = stack_linears([e.down_proj for e in experts])
        self.grouped = GroupedExperts(gate, up, down, gate_scale, up_scale, down_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])  # [T, dim]
        weights, indices = self.gate(x)  # [T, k]
        routed = (
            self._per_expert(x, weights, indices)
            if self.grouped is None
            else self.grouped(x, weights, indices)
        )
        return (routed + self.shared_experts(x)).view(shape)

    def _per_expert(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """The reference: one batched call per expert that got tokens (their counts read on the
        host), the outputs weighted and summed per token."""
        # group the (token, slot) pairs by expert
        order = indices.flatten().argsort(stable=True)
        counts = torch.bincount(indices.flatten(), minlength=len(self.experts)).tolist()
        token_idx = order // indices.size(1)
        rows = x[token_idx].split(counts)
        routed = torch.cat(
            [expert(r) for expert, r in zip(self.experts, rows, strict=True) if r.size(0)]
        )
        return torch.zeros_like(x).index_add_(
            0, token_idx, routed * weights.flatten()[order].unsqueeze(-1)
        )


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.self_attn = MLA(args, layer_id)
        self.mlp = MoE(args) if args.is_moe_layer(layer_id) else MLP(args.dim, args.inter_dim)
        self.input_layernorm = RMSNorm(args.dim, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, layout: BatchLayout, freqs_cis: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layout, freqs_cis, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Token ids in, last-position logits out; state lives in the KVCache passed to forward."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.rms_norm_eps)
        self.lm_head = _linear(args.dim, args.vocab_size)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)

    @property
    def absorb_prefill(self) -> bool:
        """Prefill chunks attend in the absorbed form, as decode does (the expanded form is the
        default: the same logits, for long prompts several times faster)."""
        return cast(Block, self.layers[0]).self_attn.absorb_prefill

    @absorb_prefill.setter
    def absorb_prefill(self, absorbed: bool) -> None:
        for layer in cast(Iterator[Block], iter(self.layers)):
            layer.self_attn.absorb_prefill = absorbed

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute non-persistent buffers (after building on the meta device and loading
        weights)."""
        self.freqs_cis = precompute_freqs_cis(self.args).to(device)

    # the packed tensors must not hold the replaced weights through an autograd graph
    @torch.no_grad()
    def pack_weights(self, *, grouped_moe: bool = False) -> None:
        """After loading: projections that read the same input become one GEMM (q_a|kv_a, each MLP's
        gate|up); with grouped_moe, each MoE layer's routed experts are stacked for the grouped
        kernel instead (MoE.stack_experts).

        Modules keep views into the packed weights, so state_dict() is unchanged; FP8 weights stay
        apart.
        """
        for layer in cast(Iterator[Block], iter(self.layers)):
            layer.self_attn.pack()
            mlps = [layer.mlp] if isinstance(layer.mlp, MLP) else [layer.mlp.shared_experts]
            if isinstance(layer.mlp, MoE) and grouped_moe:
                layer.mlp.stack_experts()
            elif isinstance(layer.mlp, MoE):
                mlps += cast(Iterator[MLP], iter(layer.mlp.experts))
            for mlp in mlps:
                mlp.pack()

    def setup_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """Allocate the latent cache in the weights' dtype and device.

        `setup_cache(B, max_seq_len)` gives each of B sequences one block holding its whole context:
        the layout `forward(tokens, start_pos, cache)` uses.
        """
        args = self.args
        return KVCache(
            args.n_layers,
            num_blocks,
            block_size,
            latent_width=args.kv_lora_rank + args.qk_rope_head_dim,
            index_width=args.index_head_dim if args.sparse else 0,
            dtype=self.lm_head.weight.dtype,
            device=self.lm_head.weight.device,
        )

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, cache: KVCache) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos..start_pos+S-1 -> logits of the last position [B,
        vocab] (fp32).

        Positions before start_pos must already be in `cache` (prefill in chunks or decode one
        token); sequence i lives in block i of a cache from `setup_cache(B, max_seq_len)`.
        """
        bsz, seqlen = tokens.shape
        assert start_pos + seqlen <= cache.block_size, (
            f"end_pos={start_pos + seqlen} > block {cache.block_size}"
        )
        assert bsz <= cache.num_blocks, f"batch {bsz} > {cache.num_blocks} blocks"
        layout = BatchLayout.contiguous(bsz, seqlen, start_pos, cache.block_size, tokens.device)
        return self.forward_batch(tokens.flatten(), layout, cache)

    @torch.inference_mode()
    def forward_batch(
        self, tokens: torch.Tensor, layout: BatchLayout, cache: KVCache
    ) -> torch.Tensor:
        """tokens: [T] of many sequences packed as `layout` says -> logits [N, vocab] (fp32) at
        layout.logits_index.

        One pass for a whole scheduling step: decode tokens and prefill chunks of different
        sequences, each attending over its own cached positions.
        """
        h = self.embed_tokens(tokens)  # [T, dim]
        freqs_cis = self.freqs_cis[layout.positions]  # [T, r/2]
        for layer in self.layers:
            h = layer(h, layout, freqs_cis, cache)
        return self.lm_head(self.norm(h[layout.logits_index])).float()


def smoke_run() -> torch.Tensor:
    """A forward pass of a tiny random model: `python -m worker_svc.model.model`, repeated as a CPU
    test."""
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=512,
        dim=256,
        inter_dim=512,
        n_layers=2,
        n_heads=4,
        max_seq_len=64,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        moe_inter_dim=64,
        n_dense_layers=1,
        n_routed_experts=8,
        n_activated_experts=2,
        n_expert_groups=2,
        n_limited_groups=1,
    )
    model = Transformer(args)
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    cache = model.setup_cache(1, 64)
    return model(torch.randint(0, 512, (1, 8)), 0, cache)


if __name__ == "__main__":
    print(smoke_run().shape)
