"""DeepSeek Sparse Attention (V3.2): the lightning indexer's token selection and MLA over the
selected tokens.

For every query token the indexer scores each earlier token t as
    sum_h w[h] * relu(q[h] . k[t] / sqrt(index_head_dim)),
with `index_n_heads` small query heads q[h], one key k[t] per token (cached next to the MLA latent)
and per-query head weights w (weights_proj(x) / sqrt(index_n_heads)), then keeps the `index_topk`
best. MLA attends only to those: its cost per query is flat past index_topk, while the scoring
stays linear in the context, over index_n_heads x index_head_dim per token. The formulas are those
of transformers' DeepseekV32Indexer. DeepSeek's code computes the same scores from FP8 operands
after a Hadamard rotation (which leaves the dot products unchanged and spreads outliers before the
quantization); where the model serves FP8 weights (sm90) it rotates q and k (`hadamard_rotate`,
keys rotated once, before they are cached) and scores with `select_tokens_fp8`, which selects
nearly, not exactly, the same tokens (docs/benchmarks/sparse-attention.md).

Long prefill chunks are processed in slices of queries so that no intermediate tensor holds more
than `_MAX_ELEMENTS` numbers.
"""

from __future__ import annotations

import functools

import torch

from worker_svc.model.kernel import act_quant

_MAX_ELEMENTS = 1 << 24  # 64 MiB of float32 per intermediate tensor


def query_slices(seqlen: int, elements_per_query: int) -> list[slice]:
    """Consecutive slices of the `seqlen` queries, each small enough for its intermediates."""
    step = max(1, _MAX_ELEMENTS // max(elements_per_query, 1))
    return [slice(start, start + step) for start in range(0, seqlen, step)]


def select_tokens(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """The `topk` key positions each query scores highest -> [b, s, topk] indices into 0..L-1.

    q: [b, s, heads, d] rope'd indexer queries; weights: [b, s, heads] float32 head weights;
    keys: [b, L, d] the cached indexer keys of positions 0..L-1; mask: [b, s, L] additive causal
    mask. Masked keys score -inf, so they are picked only by queries with fewer than topk visible
    keys (and then dropped by the attention mask, as in transformers).
    """
    batch, seqlen, heads, _ = q.shape
    keys = keys.float()
    picked = []
    for part in query_slices(seqlen, batch * heads * keys.size(1)):
        scores = (
            torch.einsum("bshd,btd->bsht", q[:, part].float(), keys).mul_(softmax_scale).relu_()
        )
        index = torch.einsum("bsh,bsht->bst", weights[:, part], scores) + mask[:, part]
        picked.append(index.topk(topk, dim=-1).indices)
    return torch.cat(picked, dim=1)


def select_tokens_fp8(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """select_tokens with DeepSeek's FP8 scoring of Hadamard-rotated q and keys (`hadamard_rotate`):
    each vector quantized to FP8 E4M3 with one scale, their FP8 products summed in float32 and
    scaled back."""
    q_fp8, q_scale = act_quant(q.float().contiguous(), q.size(-1))  # scales [b, s, heads, 1]
    k_fp8, k_scale = act_quant(keys.float().contiguous(), keys.size(-1))  # [b, L, 1]
    weights = weights * q_scale.squeeze(-1)  # relu(c x) = c relu(x) for the positive scales
    return select_tokens(q_fp8.float(), weights, k_fp8.float() * k_scale, mask, topk, softmax_scale)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H for the orthonormal Hadamard matrix H of x's last dimension: dot products are
    unchanged, outliers spread over all features before an FP8 quantization."""
    return (x.float() @ _hadamard(x.size(-1), x.device)).to(x.dtype)


@functools.cache
def _hadamard(dim: int, device: torch.device) -> torch.Tensor:
    """The orthonormal [dim, dim] Sylvester-Hadamard matrix (dim a power of two)."""
    if dim & (dim - 1):
        raise ValueError(f"FP8 indexer scoring needs a power-of-two index_head_dim, got {dim}")
    h = torch.ones(1, 1, device=device)
    while h.size(0) < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h * dim**-0.5


def sparse_attend(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    key_slots: torch.Tensor,
    mask: torch.Tensor,
    selected: torch.Tensor,
    softmax_scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """Absorbed MLA over each query's selected tokens only -> latent outputs [b, s, H, latent_dim].

    q: [b, s, H, c + r] queries in latent space; layer_cache: [slots, c + r] latent and k_pe;
    key_slots: [b, L] cache slots of positions 0..L-1; mask: [b, s, L]; selected: [b, s, k] from
    select_tokens.
    """
    batch, seqlen, heads, width = q.shape
    out = []
    for part in query_slices(seqlen, batch * selected.size(-1) * (width + heads)):
        chosen = selected[:, part]  # [b, s', k]
        slots = key_slots.gather(1, chosen.flatten(1))
        # [b, s', k, c + r]
        keys = layer_cache.index_select(0, slots.flatten()).view(*chosen.shape, width)
        scores = torch.einsum("bshc,bskc->bshk", q[:, part], keys) * softmax_scale
        scores += mask[:, part].gather(2, chosen).unsqueeze(2)
        probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q)
        # all c + r columns: one contiguous GEMM operand; the r rope columns are dropped after
        out.append(torch.einsum("bshk,bskc->bshc", probs, keys)[..., :latent_dim])
    return torch.cat(out, dim=1)
