"""The repeated-run error floor (training/step_spread.py), on synthetic rows named as such."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from training.step_spread import best_single_mape, spread


def test_best_single_prediction_is_the_inverse_weighted_median():
    assert best_single_mape(np.array([100.0, 100.0, 200.0])) == pytest.approx(100 * 0.5 / 3)
    values = np.array([40.0, 55.0, 58.0, 90.0])
    grid = np.linspace(30, 100, 7001)
    brute = min(100 * np.mean(np.abs(values - x) / values) for x in grid)
    assert best_single_mape(values) == pytest.approx(brute, abs=1e-3)


def test_spread_counts_configurations_measured_twice_or_more():
    synthetic = pd.DataFrame({
        "gpu_id": ["g"] * 5,
        "run": ["a", "b", "a", "b", "a"],
        "model": ["m1", "m1", "m2", "m2", "m3"],  # m3: one run only, left out
        "precision": ["float32"] * 5,
        "step_time_ms": [10.0, 20.0, 30.0, 30.0, 5.0],
    })  # fmt: skip
    out = spread(synthetic, "gpu_id")
    assert out.to_dict("records") == [
        {"gpu_id": "g", "runs": 2, "configs": 2, "best single prediction MAPE %": 12.5}
    ]
