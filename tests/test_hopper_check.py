"""Hopper rows stay out of training, and the held-out Hopper check scores them.

Every row here is SYNTHETIC (made-up latencies and step times on real GPU ids): the tests
check which rows are kept and the arithmetic of the check, never a model's accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from boom_ml.predict_ops import predict_ops
from data_collection import schema
from data_collection.paths import shared_data_dir
from data_collection.shards import ShardWriter, merge_by_source
from tests.test_schema import synthetic_kernel_rows, synthetic_step_rows
from training import hopper_check
from training.held_out import drop_held_out, held_out_mask
from training.kernel_rows import load_training_data


def _kernels_on(gpus: list[str]) -> pd.DataFrame:
    rows = synthetic_kernel_rows(len(gpus))
    return rows.assign(gpu_id=gpus, device_name=[f"Synthetic {g}" for g in gpus])


def test_hopper_rows_are_found_by_gpu_id_or_device_name() -> None:
    rows = _kernels_on(["h100-sxm", "h200", "gh200", "a100-80gb-sxm", "l4", "not-in-table"])
    rows.loc[5, "device_name"] = "NVIDIA H800 PCIe"  # unknown id: the name decides
    assert held_out_mask(rows).tolist() == [True, True, True, False, False, True]
    said: list[str] = []
    kept = drop_held_out(rows, "kernel", said.append)
    assert kept["gpu_id"].tolist() == ["a100-80gb-sxm", "l4"]
    assert said == [
        "held out of training: 4 kernel rows of gh200, h100-sxm, h200, not-in-table (Hopper)"
    ]


def test_training_never_loads_a_hopper_row(tmp_path: Path) -> None:
    # A Hopper dataset dropped into the canonical folder by mistake.
    schema.write_dataset(
        _kernels_on(["a100-80gb-pcie", "t4"]), "kernels", tmp_path / "kernels" / "ok.parquet"
    )
    schema.write_dataset(
        _kernels_on(["h200", "h100-sxm", "h200"]), "kernels", tmp_path / "kernels" / "h.parquet"
    )
    said: list[str] = []
    kernels = load_training_data({"dir": str(tmp_path)}, said.append)
    assert sorted(kernels["gpu_id"]) == ["a100-80gb-pcie", "t4"]
    assert said == ["held out of training: 3 kernel rows of h100-sxm, h200 (Hopper)"]


def _steps(tmp_path: Path) -> Path:
    """A measurements folder as the sweep plan leaves it: two sources in one shard root."""
    root, out = tmp_path / "shards", tmp_path / "measured"
    steps = synthetic_step_rows(3).assign(
        gpu_id=["h200", "h200", "a100-80gb-sxm"], step_time_ms=[100.0, 200.0, 50.0],
        source=["boom-h200-neusight-steps", "boom-h200-steps", "boom-h200-steps"],
        peak_allocated_bytes=[1000, 2000, 3000],
    )  # fmt: skip
    writer = ShardWriter(root, "steps", "job", flush_every=None)
    for i, row in steps.iterrows():
        writer.add(f"key{i}", [row.to_dict()])
    writer.flush()
    (root / "environment.json").write_text('{"gpu": "stub"}')  # the runner writes it
    written = merge_by_source(root, out)
    assert written == {"steps/boom-h200-neusight-steps": 1, "steps/boom-h200-steps": 2}
    assert (out / "environment.json").read_text() == '{"gpu": "stub"}'  # for the SOURCE.md
    return out


def test_step_errors_and_summary_on_synthetic_predictions(tmp_path: Path) -> None:
    rows = hopper_check.load_held_out("steps", [_steps(tmp_path)])
    assert sorted(rows["step_time_ms"]) == [100.0, 200.0]  # the A100 row is not Hopper

    def fake(row: pd.Series) -> dict[str, float]:  # +10 % and -20 %; the second misses p10..p90
        pred = {100.0: 110.0, 200.0: 160.0}[float(row["step_time_ms"])]
        return {"pred_ms": pred, "p10_ms": pred * 0.8, "p90_ms": pred * 1.2, "method": "fake",
                "pred_alloc": float(row["peak_allocated_bytes"]) * 1.5}  # fmt: skip

    said: list[str] = []
    errors = hopper_check.step_errors(rows, predict=fake, log=said.append)
    assert said[0].startswith("[1/2] torchvision:resnet18 batch 4 none: measured 1")
    assert sorted(errors["time_err"].round(6)) == [-20.0, 10.0]
    summary = hopper_check.step_summary(errors)
    assert summary.loc[("boom-h200-steps", "h200")].to_dict() == {
        "runs": 1, "time_mape": 20.0, "worst": 20.0, "off_by_15": 1, "coverage": 0.0,
        "memory_mape": 50.0,
    }  # fmt: skip
    assert summary.loc[("boom-h200-neusight-steps", "h200"), "coverage"] == 1.0


def test_sweep_models_resolve_to_the_shared_configs() -> None:
    name = hopper_check.model_name("hf:.sweep_inputs/neusight/gpt2_large.json")
    assert name == f"hf:{shared_data_dir() / 'neusight' / 'model_configs' / 'gpt2_large.json'}"
    assert Path(name[3:]).is_file()
    assert hopper_check.model_name("hf:gpt2") == "hf:gpt2"


def test_predict_step_is_the_products_prediction() -> None:
    from boom_ml.api import predict

    row = synthetic_step_rows(1).iloc[0].copy()
    row.update({"gpu_id": "h200", "model": "hf:gpt2", "model_family": "transformer",
                "image_size": None, "seq_len": 64, "batch_size": 2, "optimizer": "none",
                "tf32": False, "torch_version": "2.11.0", "cuda_version": "13.0",
                "variant": json.dumps({"attn_implementation": "eager"})})  # fmt: skip
    got = hopper_check.predict_step(row)
    want = predict("hf:gpt2", "h200", batch_size=2, seq_len=64, optimizer="none",
                   attention="eager", advice=False, max_batch="off", tf32_matmul=False,
                   tf32_cudnn=False, stack={"torch": "2.11", "cuda": "13.0"}).gpus[0]  # fmt: skip
    assert got["pred_ms"] == want.time.step_ms and got["method"] == want.time.method
    assert (got["p10_ms"], got["p90_ms"]) == (want.time.p10_ms, want.time.p90_ms)
    assert got["pred_alloc"] == want.memory.peak_allocated_bytes


def test_kernel_errors_match_predict_ops_on_the_same_shape() -> None:
    rows = _kernels_on(["h200", "h200"]).assign(
        m=[4096, 1024], n=[4096, 1024], k=[4096, 50272], latency_ms=[2.0, 3.0]
    )
    got = hopper_check.kernel_errors(rows)
    table = pd.DataFrame({"op": ["linear"] * 2, "b": [1, 1], "m": [4096, 1024], "n": [4096, 1024],
                          "k": [4096, 50272], "dtype": ["fp32"] * 2})  # fmt: skip
    pred = predict_ops(table, "h200")["pred_ms"].to_numpy()
    want = np.mean(np.abs(100 * (pred / np.array([2.0, 3.0]) - 1)))
    assert got.loc[("h200", "linear", "float32", "forward"), "mape"] == pytest.approx(
        want, abs=0.01
    )
    assert got.loc[("h200", "linear", "float32", "forward"), "rows"] == 2


def test_main_says_what_to_do_without_measurements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert hopper_check.main([str(tmp_path)]) == 1
    assert "run the device sweep first" in capsys.readouterr().out
    # a folder that does not exist is said so, not "no Hopper measurements in" it
    assert hopper_check.main([str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err == f"error: no such folder: {tmp_path / 'absent'}\n"
