"""bench/hopper_suite.py's CPU-checkable parts: the summary's verdicts from recorded figures, and
the host-sync probe its grouped-MoE step runs on the GPU. (`--dry-run` runs every step at toy
sizes on a CPU in about a minute: too slow for the suite.)"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.hopper_suite import Suite, _host_sync, summary


def _step(eager_s: float, graph_s: float | None, limit_s: float) -> dict[str, object]:
    cell: dict[str, object] = {"eager_s": eager_s, "bandwidth_limit_s": limit_s}
    if graph_s is not None:
        cell |= {"graph_s": graph_s, "same_tokens_as_eager": True}
    return cell


def test_the_summary_judges_each_target_from_the_figures(tmp_path: Path) -> None:
    suite = Suite(torch.device("cpu"), True, 1, tmp_path)
    suite.results = {
        "kernels": {"error": "RuntimeError: no GPU"},  # a failed step: no rows from it
        "tiny_checkpoints": {
            "V3 triton": {"rel_error": 0.46, "argmax": False},
            "V3 without YaRN triton": {"rel_error": 0.049, "argmax": True},
        },
        "decode_step": {
            "gpu_kind": "H100",
            "fp8 triton batch=1": _step(0.004, 0.0015, 0.001),
            "bf16 batch=1": _step(0.003, 0.0025, 0.0015),
            "fp8 triton batch=8": _step(0.01, None, 0.002),  # capture failed: eager counts
            "bf16 batch=8": _step(0.009, 0.006, 0.003),
        },
        "grouped_moe": {"fp8 batch=1": {"host_sync": "none"}, "bf16 batch=1": {}},
    }
    result = summary(suite)
    rows = {target: (figure, verdict) for target, figure, verdict in result["targets"]}
    assert rows["tiny V3 FP8 (triton) logits <= 5e-2"] == ("0.46, same argmax False", "MISSED")
    assert rows["tiny V3 without YaRN FP8 (triton) logits <= 5e-2"][1] == "met"
    assert rows["FP8 step <= 0.8x BF16, batch 1"] == ("0.60", "met")
    assert rows["FP8 step <= 0.8x BF16, batch 8"] == ("1.67", "MISSED")
    assert rows["BF16 step batch 1 <= 2x limit"] == ("1.67", "met")
    assert rows["FP8 step batch 1 <= 2x limit"] == ("1.50", "met")
    assert rows["graph replay = eager tokens"] == ("3/3", "met")
    assert rows["grouped MoE without host sync"] == ("1/1", "met")
    assert not [t for t in rows if "act_quant" in t]
    assert result["measured_fp8_decode_row"].startswith(
        '"H100": DecodeMeasurement({1: 0.60, 8: 1.67}, "'
    )


def test_the_host_sync_probe_names_what_synchronised() -> None:
    assert _host_sync(lambda: torch.arange(4) * 2, torch.device("cpu")) == "none"
    found = _host_sync(lambda: torch.arange(4).sum().item(), torch.device("cpu"))
    assert found.startswith("HostSyncError") and "_local_scalar_dense" in found
