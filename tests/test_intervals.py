"""Calibrated step-time intervals: fitted on held-out-GPU CV predictions, applied by estimate_time."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from boom_ml.gpus import get_gpu
from boom_ml.specs import StepSpec
from boom_ml.timing import estimate, gnn_features
from boom_ml.trace.step import trace_step
from tests.test_gnn import _perturbed_model
from tests.tiny_models import tiny_cnn
from training import intervals


def test_weighted_quantiles_midpoint_rule():
    x = np.arange(10.0)
    assert list(intervals.weighted_quantiles(x, np.ones(10), (0.1, 0.9))) == [0.5, 8.5]
    # One GPU with one row weighs as much as one with four.
    cal = intervals.fit(np.array([0.0, 0, 0, 0, 10]), np.array(["b"] * 4 + ["a"]))
    assert (cal["log_p10"], cal["log_p90"], cal["rows"], cal["gpus"]) == (0.0, 10.0, 5, 2)
    mid = intervals.weighted_quantiles(np.array([0.0, 0, 0, 0, 10]),
                                       np.array([0.25] * 4 + [1.0]), (0.5,))  # fmt: skip
    assert mid[0] == pytest.approx(2.0)


def _preds(log_ratio: dict[str, float], cell: str = "cnn/no-amp") -> pd.DataFrame:
    """Ten held-out rows per GPU whose measured/estimated ratio is e^log_ratio[gpu]."""
    rows = []
    for gpu, r in log_ratio.items():
        for _ in range(10):
            rows.append({"kind": "gpu", "held_out": gpu, "cell": cell, "baseline_ms": 10.0,
                         "gnn_ms": 20.0, "target_ms": 10.0 * math.exp(r), "source": "s"})  # fmt: skip
    return pd.DataFrame(rows)


def test_calibration_per_method():
    p = pd.concat([_preds({"a": 0.0, "b": 1.0}), _preds({"c": 0.5}, cell="transformer/amp")])
    cal = intervals.calibrate(p, {"cnn/no-amp": True})
    # per-op: every row's baseline (log ratios 0, 1, 0.5), each GPU weighted alike
    assert cal["per-op"]["rows"] == 30 and cal["per-op"]["log_p10"] == pytest.approx(0.0)
    assert cal["per-op"]["log_p90"] == pytest.approx(1.0)
    # gnn: only the rows of cells that use the GNN (a, b), against 20 ms
    assert cal["gnn"]["rows"] == 20
    assert cal["gnn"]["log_p10"] == pytest.approx(math.log(0.5))
    assert cal["gnn"]["log_p90"] == pytest.approx(math.log(0.5) + 1.0)


def test_coverage_of_a_gpu_uses_the_interval_calibrated_without_it():
    p = _preds({"a": 0.0, "b": 0.0, "c": 1.0})
    cov = intervals.held_out_coverage(p, {})
    share = cov.groupby("held_out")["inside"].mean()
    # a and b: calibrated on {b or a, c} -> [est, e*est] holds them; c: on {a, b} -> [est, est]
    assert share.to_dict() == {"a": 1.0, "b": 1.0, "c": 0.0}
    table = intervals.coverage_table(p, {}).set_index("rows of")["80% interval coverage %"]
    assert table["gpu=c"] == 0.0 and table["all (pooled rows)"] == pytest.approx(66.7)


@pytest.mark.parametrize("use_gnn", [True, False])
def test_estimate_time_applies_the_packaged_interval(monkeypatch, use_gnn):
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, image_size=16, optimizer="none"))
    manifest = {"per_op": gnn_features.per_op_function(None)[0],
                "use_gnn": {"cnn/no-amp": use_gnn},
                "interval": {"gnn": {"log_p10": -0.2, "log_p90": 0.3},
                             "per-op": {"log_p10": -0.5, "log_p90": 0.1}}}  # fmt: skip
    monkeypatch.setattr(estimate, "load_model", lambda: (_perturbed_model(), manifest))
    est = estimate.estimate_time(graph, get_gpu("l4"))
    lo, hi = (-0.2, 0.3) if use_gnn else (-0.5, 0.1)
    assert (est.method == "gnn") == use_gnn
    assert est.p10_ms == pytest.approx(est.step_ms * math.exp(lo), rel=1e-12)
    assert est.p90_ms == pytest.approx(est.step_ms * math.exp(hi), rel=1e-12)
