"""NeuSight's labels against the sum of NeuSight's own per-op timings (training/label_check.py)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from data_collection.paths import shared_data_dir
from training.label_check import layer_sums, main, ops_sum_mape

SHARED = shared_data_dir()


def test_layer_sums_repeat_the_first_layer() -> None:
    # SYNTHETIC ops: an embedding, two ops of block 0 (and one unnamed op between them), a head.
    ops = pd.DataFrame({
        "node_index": [0, 1, 2, 3, 4],
        "node_name": ["wte", "transformer_h_0_ln_1", "addmm", "transformer_h_0_mlp_act", "lm_head"],
        "fw_ms": [1.0, 2.0, 3.0, 4.0, 5.0], "bw_ms": [0.5, 1.0, 1.0, 1.0, 2.0],
    })  # fmt: skip
    assert layer_sums(ops, num_layer=10) == (1.0 + 10 * 9.0 + 5.0, 0.5 + 10 * 3.0 + 2.0)
    with pytest.raises(ValueError, match="no node of the first layer"):
        layer_sums(ops.assign(node_name="x"), 2)


@pytest.mark.skipif(not (SHARED / "neusight").is_dir(), reason=f"no NeuSight data in {SHARED}")
def test_a100_80gb_labels_against_their_own_op_timings(tmp_path: Path) -> None:
    from data_collection.import_public import import_all

    import_all(out_dir=tmp_path, only=["neusight"], progress=False)
    flat = main(tmp_path)
    # Summing NeuSight's own op timings misses its A100-80GB step labels by 9.1 % on average.
    assert ops_sum_mape(flat)["NVIDIA_A100_80GB_PCIe"] == pytest.approx(9.1, abs=0.05)
    table = flat.set_index(["gpu", "label"])
    assert len(table) == 14  # the training labels with a per-op CSV (switchxl4 has none)
    a100 = table.loc["NVIDIA_A100_80GB_PCIe"]
    # gpt3_xl's forward label equals its ops' sum; gpt3_27's is 1.61 times it.
    assert a100.loc["gpt3_xl-train-2048-1", "fw_ratio"] == pytest.approx(1.001, abs=0.001)
    assert a100.loc["gpt3_27-train-2048-1", "fw_ratio"] == pytest.approx(1.609, abs=0.001)
    assert (a100["fw_ratio"] > 1.3).sum() == 5 and (a100["bw_ratio"].between(0.9, 1.05)).all()
