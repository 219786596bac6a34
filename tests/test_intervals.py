"""Calibrated step-time intervals: fitted on held-out-GPU CV predictions, applied by estimate_time."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from boom_ml.gpus import get_gpu
from boom_ml.specs import StepSpec
from boom_ml.timing import estimate, gnn_artifact, gnn_features
from boom_ml.timing.gnn_artifact import interval_for
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
                         "gnn_ms": 20.0, "target_ms": 10.0 * math.exp(r), "source": "s",
                         "family": cell.split("/")[0]})  # fmt: skip
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
    table = intervals.coverage_table(cov).set_index("rows of")["80% interval coverage %"]
    assert table["gpu=c"] == 0.0 and table["all (pooled rows)"] == pytest.approx(66.7)


def _synthetic_family_preds() -> pd.DataFrame:
    """Synthetic CV rows, all predicted by the per-op sum (baseline 10 ms): "cnn" misses
    widely, 1-3 rows per GPU (log ratio a: -0.5; b: -0.1, 0; c: 0.3, 0.4, 0.5; d: 0.7),
    "transformer" narrowly, 12 rows per GPU within ±0.01, "other" only on GPUs a and b."""
    rows = []

    def add(family: str, gpu: str, logs: list[float]) -> None:
        for r in logs:
            rows.append({"kind": "gpu", "held_out": gpu, "cell": f"{family}/no-amp",
                         "family": family, "baseline_ms": 10.0, "gnn_ms": 10.0,
                         "target_ms": 10.0 * math.exp(r), "source": family})  # fmt: skip

    for k, gpu in enumerate("abcd"):
        add("cnn", gpu, [-0.5 + 0.4 * k + d for d in (0.0, 0.1, 0.2)][: 1 + k % 3])
        add("transformer", gpu, [-0.01, 0.0, 0.01, 0.0] * 3)
    add("other", "a", [0.02] * 4)
    add("other", "b", [-0.02] * 4)
    return pd.DataFrame(rows)


def test_calibration_per_family_where_its_rows_span_enough_gpus():
    p = _synthetic_family_preds()
    cal = intervals.calibrate(p, {})
    for family in ("cnn", "transformer"):
        rows = p[p["family"] == family]
        logs = np.log(rows["target_ms"] / rows["baseline_ms"]).to_numpy()
        w = 1.0 / rows["held_out"].map(rows["held_out"].value_counts()).to_numpy(dtype=float)
        got = cal["by_family"][family]["per-op"]
        lo, hi = intervals.weighted_quantiles(logs, w, intervals.quantile_levels(got["level"]))
        assert (got["log_p10"], got["log_p90"]) == (lo, hi)
        assert (got["rows"], got["gpus"]) == (len(rows), rows["held_out"].nunique())
    assert cal["by_family"]["cnn"]["per-op"]["log_p90"] > 0.5  # wide
    assert cal["by_family"]["transformer"]["per-op"]["log_p90"] < 0.01  # narrow
    # "other" spans 2 GPUs < MIN_GPUS: no entry of its own, but its rows count in the pooled one
    assert intervals.MIN_GPUS == 3 and set(cal["by_family"]) == {"cnn", "transformer"}
    assert cal["per-op"]["rows"] == len(p) and "gnn" not in cal["by_family"]["cnn"]


def _biased_preds(biases: list[float]) -> pd.DataFrame:
    """Synthetic CV rows: ten per GPU, log ratios bias + (-0.45, -0.35, ..., 0.45)."""
    spread = np.linspace(-0.45, 0.45, 10)
    return pd.DataFrame([{"kind": "gpu", "held_out": f"g{k}", "cell": "cnn/no-amp",
                          "family": "cnn", "baseline_ms": 10.0, "gnn_ms": 10.0,
                          "target_ms": 10.0 * math.exp(b + d), "source": "s"}
                         for k, b in enumerate(biases) for d in spread])  # fmt: skip


def test_choose_level_keeps_the_percentiles_where_gpus_err_alike():
    # every GPU's rows alike: the p10/p90 of the others (midpoints of the 1st/2nd and
    # 9th/10th values) hold 8 of its 10 rows, 80 %: the narrowest level is kept
    p = _biased_preds([0.0] * 5)
    assert intervals.choose_level(p, {}) == 0.8
    assert intervals.held_out_coverage(p, {}, 0.8)["inside"].mean() == pytest.approx(0.8)
    assert intervals.calibrate(p, {})["per-op"]["level"] == 0.8


def test_choose_level_widens_for_an_error_of_each_gpus_own():
    p = _biased_preds([-0.3, -0.1, 0.0, 0.15, 0.35])
    level = intervals.choose_level(p, {})
    # the narrowest level of the grid that holds TARGET of the held-out rows
    assert level > 0.8 and level in intervals.LEVEL_GRID
    inside = {lv: intervals.held_out_coverage(p, {}, lv)["inside"].mean()
              for lv in intervals.LEVEL_GRID}  # fmt: skip
    assert inside[level] >= intervals.TARGET
    assert all(inside[lv] < intervals.TARGET for lv in intervals.LEVEL_GRID if lv < level)
    cal = intervals.calibrate(p, {})["per-op"]
    plain = intervals.calibrate(p, {}, 0.8)["per-op"]
    assert cal["level"] == level
    assert cal["log_p10"] < plain["log_p10"] and cal["log_p90"] > plain["log_p90"]
    # a GPU's held-out coverage nests the choice: its level is chosen without it
    cov = intervals.held_out_coverage(p, {})
    rest = p[p["held_out"] != "g4"]
    own = intervals.calibrate(rest, {}, intervals.choose_level(rest, {}))["per-op"]
    ratio = cov.loc[cov["held_out"] == "g4", "target_ms"] / 10.0
    want = (math.exp(own["log_p10"]) <= ratio) & (ratio <= math.exp(own["log_p90"]))
    assert (cov.loc[cov["held_out"] == "g4", "inside"] == want).all()


def test_choose_level_with_one_gpu_keeps_the_target_and_quantile_levels():
    assert intervals.choose_level(_biased_preds([0.2]), {}) == intervals.TARGET
    # the packaged level's quantiles, rounded free of float noise (0.94, not 0.9400000000000001)
    assert intervals.quantile_levels(0.88) == (0.06, 0.94)


def test_interval_for_falls_back_to_the_method_interval():
    pooled = {"gnn": {"log_p10": -0.2, "log_p90": 0.3}, "per-op": {"log_p10": -0.5, "log_p90": 0.1}}
    fam = {"cnn": {"per-op": {"log_p10": -0.9, "log_p90": 0.7}}}
    new = {"interval": {**pooled, "by_family": fam}}
    assert interval_for(new, "per-op", "cnn") == (-0.9, 0.7)
    assert interval_for(new, "gnn", "cnn") == (-0.2, 0.3)  # no cnn/gnn entry
    assert interval_for(new, "per-op", "transformer") == (-0.5, 0.1)  # no family entry
    assert interval_for(new, "per-op") == (-0.5, 0.1)
    old = {"interval": pooled}  # manifests packaged before by_family
    assert interval_for(old, "per-op", "cnn") == (-0.5, 0.1)
    assert interval_for({}, "gnn", "cnn") is None


def test_held_out_coverage_scores_with_the_family_interval():
    p = _synthetic_family_preds()
    cov = intervals.held_out_coverage(p, {})
    # GPU c's cnn rows (log ratios 0.3, 0.4, 0.5): the pooled interval of the other GPUs
    # stops below them, cnn's own (GPUs a, b, d: -0.5 ... 0.8) holds them
    cal = intervals.calibrate(p[p["held_out"] != "c"], {})
    assert cal["per-op"]["log_p90"] < 0.3
    own = cal["by_family"]["cnn"]["per-op"]
    assert own["log_p10"] < 0.3 and own["log_p90"] > 0.5
    mine = cov[(cov["held_out"] == "c") & (cov["family"] == "cnn")]
    assert len(mine) == 3 and mine["inside"].all()
    # "other" has no family entry without GPU a (only b): the pooled bounds score its rows
    cal = intervals.calibrate(p[p["held_out"] != "a"], {})
    assert "other" not in cal["by_family"]
    lo, hi = math.exp(cal["per-op"]["log_p10"]), math.exp(cal["per-op"]["log_p90"])
    mine = cov[(cov["held_out"] == "a") & (cov["family"] == "other")]
    want = (10.0 * lo <= mine["target_ms"]) & (mine["target_ms"] <= 10.0 * hi)
    assert len(mine) == 4 and (mine["inside"] == want).all()


@pytest.mark.parametrize("use_gnn", [True, False])
def test_estimate_time_applies_the_packaged_interval(monkeypatch, use_gnn):
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, image_size=16, optimizer="none"))
    manifest = {"per_op": gnn_features.per_op_function(None)[0],
                "use_gnn": {"cnn/no-amp": use_gnn},
                "interval": {"gnn": {"log_p10": -0.2, "log_p90": 0.3},
                             "per-op": {"log_p10": -0.5, "log_p90": 0.1}}}  # fmt: skip
    monkeypatch.setattr(
        estimate, "load_weights", lambda: (gnn_artifact.weights_of(_perturbed_model()), manifest)
    )
    est = estimate.estimate_time(graph, get_gpu("l4"))
    lo, hi = (-0.2, 0.3) if use_gnn else (-0.5, 0.1)
    assert (est.method == "gnn") == use_gnn
    assert est.p10_ms == pytest.approx(est.step_ms * math.exp(lo), rel=1e-12)
    assert est.p90_ms == pytest.approx(est.step_ms * math.exp(hi), rel=1e-12)


def test_estimate_time_applies_the_family_interval(monkeypatch):
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, image_size=16, optimizer="none"))
    pooled = {"log_p10": -0.5, "log_p90": 0.1}
    manifest = {"per_op": gnn_features.per_op_function(None)[0], "use_gnn": {"cnn/no-amp": False},
                "interval": {"per-op": pooled, "by_family": {
                    "cnn": {"per-op": {"log_p10": -0.7, "log_p90": 0.6}},
                    "transformer": {"per-op": {"log_p10": -0.1, "log_p90": 0.05}}}}}  # fmt: skip
    monkeypatch.setattr(
        estimate, "load_weights", lambda: (gnn_artifact.weights_of(_perturbed_model()), manifest)
    )
    est = estimate.estimate_time(graph, get_gpu("l4"))  # tiny_cnn's graph: model_family "cnn"
    assert est.p10_ms == pytest.approx(est.step_ms * math.exp(-0.7), rel=1e-12)
    assert est.p90_ms == pytest.approx(est.step_ms * math.exp(0.6), rel=1e-12)
