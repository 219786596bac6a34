"""The per-op sum against timm's inference benchmarks on GPUs without kernel rows
(training/infer_check.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from data_collection.paths import shared_data_dir
from training.infer_check import (
    _options,
    conv_kind,
    gemm_rates,
    layout_ratio,
    main,
    pick_models,
    select_rows,
    summary,
)

SHARED = shared_data_dir()


def _node(
    shapes: list[list[int]], family: str = "conv", phase: str = "forward", flops: int = 10
) -> dict:
    return {"family": family, "phase": phase, "input_shapes": json.dumps(shapes), "flops": flops}


def test_conv_kind_finds_one_input_channel_per_group() -> None:
    # SYNTHETIC node tables: a dense 3x3 convolution, a depthwise one (32 groups of 1 channel),
    # a grouped one (2 groups of 16), and a depthwise weight seen only in backward.
    dense = _node([[8, 32, 56, 56], [64, 32, 3, 3]])
    depthwise = _node([[8, 32, 56, 56], [32, 1, 3, 3]])
    grouped = _node([[8, 32, 56, 56], [32, 16, 3, 3]])
    backward = _node([[8, 32, 56, 56], [8, 32, 56, 56], [32, 1, 3, 3]], phase="backward")
    assert conv_kind(pd.DataFrame([dense, depthwise])) == "depthwise"
    assert conv_kind(pd.DataFrame([dense, grouped, backward])) == "conv"
    # a 1-channel input (a greyscale stem) is not depthwise: its weight has 1 input channel too
    assert conv_kind(pd.DataFrame([_node([[8, 1, 28, 28], [16, 1, 3, 3]])])) == "conv"
    # a patch embedding's convolution beside matmuls doing most of the FLOPs
    gemm = _node([[8, 128], [128, 64]], family="gemm", flops=11)
    assert conv_kind(pd.DataFrame([dense, gemm])) == "other"
    assert conv_kind(pd.DataFrame([dense, gemm.copy() | {"flops": 10}])) == "conv"
    assert conv_kind(pd.DataFrame([gemm])) == "other"


def test_select_rows_keeps_eager_rows_of_gpus_without_kernel_rows() -> None:
    # SYNTHETIC steps: one row each of what is kept and of every reason to leave a row out.
    steps = pd.DataFrame({
        "source": ["timm_infer", "timm_infer", "timm_infer", "timm_infer", "timm_train"],
        "gpu_id": ["rtx-4090", "rtx-4090", "a100-80gb-pcie", "h100-sxm", "rtx-4090"],
        "device_name": ["", "", "", "", ""],
        "variant": ["", "dynamo", "", "", ""],
        "model": ["a", "b", "c", "d", "e"],
    })  # fmt: skip
    assert select_rows(steps, {"a100-80gb-pcie"})["model"].tolist() == ["a"]


def test_pick_models_is_seeded_and_skips_models_timm_dropped() -> None:
    rows = pd.DataFrame({"model": [f"timm:m{i}" for i in range(10)] * 2})
    available = {f"m{i}" for i in range(10)} - {"m3"}
    first = pick_models(rows, 4, seed=1, available=available)
    assert first == pick_models(rows, 4, seed=1, available=available)
    assert len(first) == 4 and "timm:m3" not in first and first == sorted(first)
    assert len(pick_models(rows, 50, seed=1, available=available)) == 9


def test_summary_counts_mape_ratio_and_the_share_within_15_percent() -> None:
    # SYNTHETIC: errors of +10 % and -20 % on one GPU, +50 % on another
    scored = pd.DataFrame({"gpu_id": ["x", "x", "y"], "pred_ms": [110.0, 80.0, 15.0],
                           "step_time_ms": [100.0, 100.0, 10.0]})  # fmt: skip
    table = summary(scored, ["gpu_id"])
    assert table.loc["x"].tolist() == [2, 15.0, 0.95, 50.0]
    assert table.loc["y"].tolist() == [1, 50.0, 1.5, 0.0]


def test_gemm_rates_take_each_gpus_fastest_measured_row() -> None:
    # SYNTHETIC rows: 2e12 GEMM FLOPs in 20 ms (>= 100 TFLOPS) beats 1e12 in 20 ms
    scored = pd.DataFrame({"gpu_id": ["rtx-4090", "rtx-4090"], "model": ["a", "b"],
                           "batch_size": [8, 16], "gemm_flops": [1e12, 2e12],
                           "step_time_ms": [20.0, 20.0], "gemm_pred_ms": [10.0, 40.0]})  # fmt: skip
    row = gemm_rates(scored).loc["rtx-4090"]
    assert row["model"] == "b" and row["measured TFLOPS >="] == 100.0
    assert row["per-op TFLOPS"] == 50.0 and row["fp16 spec TFLOPS"] == 165.2  # gpus.csv


def test_layout_ratio_pairs_the_same_configuration() -> None:
    # SYNTHETIC: one model measured in both layouts (ratio 1.2), one only in NCHW
    rows = pd.DataFrame({"gpu_id": ["g"] * 3, "torch_version": ["2.4.0"] * 3,
                         "model": ["a", "a", "b"], "batch_size": [8, 8, 8],
                         "image_size": [224, 224, 224], "channels_last": [False, True, False],
                         "step_time_ms": [12.0, 10.0, 5.0]})  # fmt: skip
    table = layout_ratio(rows)
    assert table.loc[("g", "2.4.0")].tolist() == [1, 1.2, 1.2]


def test_bad_options_are_one_line_and_exit_2(capsys) -> None:
    assert main(["--models", "0"]) == 2
    assert main(["--bogus", "1"]) == 2
    assert main(["--seed=-3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: --models takes a positive whole number, not '0'")
    assert err[1].startswith("error: unknown or incomplete option '--bogus'")
    assert err[2].startswith("error: --seed takes a non-negative whole number, not '-3'")
    assert _options(["--models=3", "--seed", "5"]) == (3, 5)


@pytest.mark.skipif(not (SHARED / "timm_bench").is_dir(), reason=f"no timm data in {SHARED}")
def test_real_rows_and_one_real_prediction(tmp_path: Path) -> None:
    from data_collection.import_public import import_all
    from data_collection.schema import load_steps
    from training.infer_check import predict_rows

    import_all(out_dir=tmp_path, only=["timm_bench"], progress=False)
    steps = load_steps(tmp_path, sources=["timm_infer"])
    kernel_gpus = {"a100-40gb-pcie", "a100-80gb-pcie", "a40", "gtx-1080-ti", "l4",
                   "p100-pcie-16gb", "p4", "t4", "titan-xp", "v100-pcie-32gb", "v100-sxm2-16gb"}  # fmt: skip
    rows = select_rows(steps, kernel_gpus)
    # timm_bench/SOURCE.md's eager files: RTX 3090 932+929+1291+1204+1443+1430 rows,
    # RTX 4090 1444+1441+1627, RTX 5090 1627, RTX PRO 6000 1629 (its fp16 AMP file)
    assert rows.groupby("gpu_id").size().to_dict() == {
        "rtx-3090": 7229, "rtx-4090": 4512, "rtx-5090": 1627,
        "rtx-pro-6000-blackwell-max-q": 1629}  # fmt: skip
    one = rows[(rows["model"] == "timm:resnet50") & (rows["gpu_id"] == "rtx-4090")
               & (rows["torch_version"] == "2.9.1") & (rows["image_size"] == 160)]  # fmt: skip
    scored = predict_rows(one, log=lambda _: None, cache_dir=tmp_path / "graphs")
    assert scored["step_time_ms"].tolist() == [123.268]  # batch 1024, measured
    assert scored["kind"].tolist() == ["conv"]
    assert scored["gemm_flops"].iloc[0] == 2 * 1024 * 2048 * 1000  # the classifier's linear
    # the packaged per-op sum of its forward, 1.55 times the measurement (no fp16 convolution
    # of an Ada GPU was measured; the conv head extrapolates from Volta and Turing)
    assert scored["pred_ms"].iloc[0] / 123.268 == pytest.approx(1.55, abs=0.01)
    # the least of its per-op sums on it and the packaged GPUs it beats on every number:
    # none of those (the A40, A10G, V100s, ...) is timed faster on this forward
    assert scored["dominated_ms"].iloc[0] == scored["pred_ms"].iloc[0]
