"""run_bias: held-out step predictions per measuring run (synthetic predictions)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from training.run_bias import run_table


def test_medians_per_run_gpu_and_precision_from_the_rows_the_predictions_index() -> None:
    rows = pd.DataFrame({
        "source": ["cnn_step_times"] * 4 + ["neusight_labels"],
        "gpu_id": ["titan-rtx", "titan-rtx", "titan-rtx", "rtx-2080-ti", "l4"],
        "target_ms": [10.0, 20.0, 40.0, 10.0, 5.0],
        "run_id": ["script2020"] * 4 + [""],
        "source_path": ["results/TitanRTX/a.csv"] * 3 + ["results/2080ti(2)/b.csv", ""],
        "precision": ["float16"] * 5,
    })  # fmt: skip
    preds = pd.DataFrame({
        "kind": ["gpu"] * 5 + ["family"],
        "row": [0, 1, 2, 3, 4, 0],
        "gnn_ms": [20.0, 20.0, 20.0, 5.0, 5.0, 1.0],  # x2, x1, x0.5 | x0.5
        "baseline_ms": [10.0, 20.0, 40.0, 10.0, 5.0, 1.0],
    })  # fmt: skip
    table = run_table(preds, rows).set_index("gpu_id")
    assert list(table.index) == ["rtx-2080-ti", "titan-rtx"]  # NeuSight and family folds out
    rtx = table.loc["titan-rtx"]
    assert (rtx["folder"], rtx["rows"]) == ("TitanRTX", 3)
    assert rtx["gnn_median_log"] == 0.0 and rtx["per_op_median_log"] == 0.0
    assert table.loc["rtx-2080-ti", "gnn_median_log"] == pytest.approx(np.log(0.5))
    assert table.loc["rtx-2080-ti", "folder"] == "2080ti(2)"


def test_month_correction_uses_only_the_other_gpus_of_that_month() -> None:
    from training.run_bias import month_corrected

    rows = pd.DataFrame({
        "source": ["cnn_step_times"] * 3,
        "gpu_id": ["titan-rtx", "titan-xp", "gtx-1080-ti"],
        "target_ms": [10.0, 10.0, 10.0],
        "run_id": ["script2020", "script2020", "script2018"],
        "source_path": ["results/TitanRTX/a.csv", "results/TITANXP/b.csv", "results/1080TI/c.csv"],
        "precision": ["float16"] * 3,
    })  # fmt: skip
    preds = pd.DataFrame({"kind": ["gpu"] * 3, "row": [0, 1, 2],
                          "gnn_ms": [20.0, 20.0, 5.0], "baseline_ms": [10.0] * 3})  # fmt: skip
    table = month_corrected(preds, rows).set_index("gpu")
    # Both Jan 2021 cards are predicted 2x too slow: each one's month-mate removes it exactly.
    assert table.loc["titan-rtx", "gnn_mape"] == 100.0
    assert table.loc["titan-rtx", "month_corrected_mape"] == pytest.approx(0.0, abs=1e-12)
    # The Oct 2018 card has no month-mate: unchanged.
    assert table.loc["gtx-1080-ti", "month_corrected_mape"] == table.loc["gtx-1080-ti", "gnn_mape"]


def test_a_missing_or_foreign_csv_is_one_line(tmp_path) -> None:
    """A path that is not there, or a CSV that is no cv_predictions.csv: one line, no traceback."""
    import pytest

    from training.run_bias import main

    with pytest.raises(
        SystemExit, match=r"^run_bias: cannot read .*nope.csv \(FileNotFoundError\)$"
    ):
        main([str(tmp_path / "nope.csv")])
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(
        SystemExit, match="lacks gnn_ms, held_out, kind, row: pass a train_gnn run's"
    ):
        main([str(other)])
