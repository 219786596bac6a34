"""``training.validate_parallel`` on vTrain's measured Megatron rows (shared/data/vtrain).

The validation predicts every row; one row it cannot predict ends the run. A layout began
refusing ``parallel.grad_accumulation=fused`` with one micro-batch (the twenty-fifth session),
and the four vTrain rows with one micro-batch per step crashed the whole validation."""

from __future__ import annotations

import pytest

from boom_ml.gpus import get_gpu
from training.validate_parallel import DATA, GPU, load_rows, predict_row

pytestmark = pytest.mark.skipif(
    not (DATA / "ground_truth_multi.csv").is_file(), reason="vTrain data not in ../shared/data"
)


def test_a_row_of_one_micro_batch_is_predicted() -> None:
    rows = load_rows()
    assert len(rows) == 1549
    one = [r for r in rows if r["global"] // (r["micro"] * r["dp"]) == 1]
    assert len(one) == 4
    row = min(one, key=lambda r: r["hidden"] * r["layers"])
    t = predict_row(row, get_gpu(GPU))
    assert t["accumulate_ms"] == 0.0 and t["step_ms"] > 0
    # Megatron all-reduces fp16 gradients (2 bytes a parameter) once, after the backward
    (reduce,) = [c for c in t["collectives"] if c["group"] == "dp"]
    stage = t["per_stage"][0]
    assert (reduce["op"], reduce["calls"], reduce["bytes"]) == (
        "all_reduce",
        1,
        2 * stage["trainable"],
    )
