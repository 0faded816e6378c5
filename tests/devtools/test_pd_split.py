"""devtools/pd_split.py and ``python -m infermesh plan --workers``: a fleet's prefill:decode split
from prefill's compute against decode's bandwidth, hand-computed on DeepSeek-V3."""

from __future__ import annotations

import pytest

from devtools.main import main
from devtools.pd_split import pd_split
from worker_svc.hardware.gpu_profiles import gpu_profiles
from worker_svc.hardware.sizing import model_size_of
from worker_svc.sim_engine.roofline import Roofline


def _h200_x8(attention: bool = False) -> Roofline:
    size = model_size_of("DeepSeek-V3")
    flops_per_key = size.attention_flops_per_key if attention else 0.0
    return Roofline(gpu_profiles()["H200"], 8, size, attention_flops_per_key=flops_per_key)


def test_the_split_is_the_ratio_of_prefill_compute_to_decode_bandwidth():
    roofline = _h200_x8()
    split = pd_split(roofline, prompt=8000, output=500, workers=16, max_parallel=32)
    size = roofline.size
    # 8,000 tokens x 2 x 37.6B active weights on 8 x 1,979 TFLOP/s
    assert split.prefill_s == pytest.approx(8000 * 2 * size.active_params / (8 * 1979e12))
    # 32 sequences of 8,250 tokens a step: the active weights and their KV read at 8 x 4.8 TB/s
    step = (size.active_params + 32 * 8250 * 61 * 576 * 2) / (
        8 * 4.8e12
    ) + 32 * 2 * size.active_params / (8 * 1979e12)
    assert split.batch == 32
    assert split.decode_s == pytest.approx(500 * step / 32)
    share = split.prefill_s / (split.prefill_s + split.decode_s)
    assert split.prefill_workers == round(16 * share) and split.decode_workers == 16 - round(
        16 * share
    )
    # longer answers want more decode workers, longer prompts more prefill workers
    assert pd_split(roofline, 8000, 4000, 16, 32).prefill_workers < split.prefill_workers
    assert pd_split(roofline, 64000, 500, 16, 32).prefill_workers > split.prefill_workers
    # always at least one of each
    assert pd_split(roofline, 1, 100_000, 4, 32).prefill_workers == 1
    assert pd_split(roofline, 120_000, 1, 4, 32).decode_workers == 1
    with pytest.raises(ValueError, match="2 workers"):
        pd_split(roofline, 8000, 500, 1, 32)


def test_a_decode_batch_is_what_the_kv_cache_holds_when_that_is_fewer():
    roofline = _h200_x8()
    contexts = roofline.kv_capacity_tokens // 100_500
    assert 0 < contexts < 256
    assert pd_split(roofline, 100_000, 500, 8, 256).batch == contexts


def test_plan_prints_a_split_per_kind_and_refuses_a_bad_one(capsys):
    args = ["plan", "DeepSeek-V3", "--gpu", "H200,A100", "--count", "8", "--workers", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| H200 | 8 |")]
    # attention's FLOPs counted from the model's config by default (61 layers x 128 heads x 2 x
    # (512 + 64 + 512)), as --attention-flops-per-key 16990208 would
    assert model_size_of("DeepSeek-V3").attention_flops_per_key == 61 * 128 * 2 * (576 + 512)
    split = pd_split(_h200_x8(attention=True), 8000, 500, 16, 32)
    assert len(rows) == 1
    assert rows[0].endswith(f"| {split.prefill_workers}:{split.decode_workers} |")
    prefill_s = f"| {split.prefill_s:.3f} |"
    assert prefill_s in rows[0]
    assert f"| {pd_split(_h200_x8(), 8000, 500, 16, 32).prefill_s:.3f} |" not in rows[0]
    # 8 x A100 do not hold DeepSeek-V3's BF16 weights
    assert "| A100 | 8 | the weights leave no room for one request |" in out
    for bad in (["--workers", "1"], ["--workers", "4", "--output-tokens", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", "DeepSeek-V3", *bad])
        assert "plan: a split needs" in str(exit_.value.code)
