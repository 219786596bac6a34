"""The anchor cap: no kernel is timed slower on a GPU than on a measured GPU it dominates.

The first tests use synthetic rows and a stub model whose times are made up, so that every
capped value is exact; the later ones the packaged models and the packaged GPU table.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
from test_train_ops import data_dir, small_kernels, small_model  # noqa: F401

from boom_ml.gpus import get_gpu
from boom_ml.specs import StepSpec
from boom_ml.timing.anchors import CAP_NOTE, cap, dominates, time_kernel_rows, time_uncapped
from boom_ml.timing.gemm import load_gemm_model
from boom_ml.timing.heads import load_model


@pytest.mark.parametrize(
    ("gpu", "other", "expected"),
    [
        ("a100-80gb-pcie", "a100-40gb-pcie", True),  # more bandwidth and power, same chip
        ("a100-80gb-pcie", "v100-pcie-32gb", True),
        ("a100-80gb-pcie", "t4", False),  # the T4's boost clock is higher (1590 vs 1410 MHz)
        ("h100-sxm", "a100-80gb-pcie", True),
        ("l4", "t4", False),  # 300 GB/s against the T4's 320
        ("a100-40gb-pcie", "a100-80gb-pcie", False),
        ("a100-40gb-sxm", "a100-40gb-pcie", True),  # 400 W against 250
        ("t4", "t4", False),  # not itself
    ],
)
def test_dominance_on_the_packaged_table(gpu, other, expected):
    assert dominates(get_gpu(gpu), get_gpu(other)) is expected


def test_a_user_spec_that_took_a_measured_gpus_id_is_capped_by_it():
    # a YAML copy of the A100-40GB PCIe under its own id, twice the SMs: another GPU, which the
    # heads never measured, so its rows are capped at the packaged card's
    a100 = get_gpu("a100-40gb-pcie")
    faster = dataclasses.replace(a100, sm_count=2 * a100.sm_count)
    assert dominates(faster, a100) and not dominates(a100, a100)
    rows, model, gemm = _kernel_rows(), load_model(), load_gemm_model()
    theirs = time_uncapped(rows, [a100], model, gemm)["pred_ms"].to_numpy()
    ours = time_kernel_rows(rows, faster, model, gemm)
    measured = rows["family"].map(lambda f: "a100-40gb-pcie" in model.heads[f].gpus)
    assert (ours["pred_ms"].to_numpy()[measured.to_numpy()] <= theirs[measured.to_numpy()]).all()
    assert ours["method"].str.endswith("(capped at a100-40gb-pcie)").any()
    # the packaged card itself keeps its own predictions
    assert not time_kernel_rows(rows, a100, model, gemm)["method"].str.contains("capped").any()


def test_a_blank_field_is_not_at_least_as_good():
    h100 = get_gpu("h100-sxm")
    assert not dominates(dataclasses.replace(h100, id="mine", l2_cache_mb=None), get_gpu("t4"))
    # a field the other GPU leaves blank is not compared
    blank = dataclasses.replace(get_gpu("t4"), id="blank-t4", l2_cache_mb=None)
    assert dominates(h100, blank)


class StubHead:
    def __init__(self, gpus):
        self.gpus = gpus


class StubModel:
    """A per-op model (synthetic) whose elementwise head measured the V100 and P100 only."""

    heads = {"elementwise": StubHead(["v100-pcie-32gb", "p100-pcie-16gb"])}


ROWS = pd.DataFrame({"op": ["add", "mul", "sdpa"], "family": ["elementwise", "elementwise", "attention"],
                     "dtype": "float32", "direction": "forward", "numel": [8, 8, 8]})  # fmt: skip


def test_a_row_is_lowered_to_the_least_of_its_anchors_and_says_which():
    gpus = [get_gpu("a100-40gb-pcie"), get_gpu("v100-pcie-32gb")]
    pred = pd.DataFrame({
        "pred_ms": [5.0, 1.0, 9.0, 5.0, 1.0, 9.0], "p10_ms": [2.5, 0.5, 8.0, 2.5, 0.5, 8.0],
        "p90_ms": [10.0, 2.0, 10.0, 10.0, 2.0, 10.0],
        "method": ["per-op", "per-op", "roofline-calibrated (proxy: gemm)"] * 2})  # fmt: skip
    asked = []

    def time_on(specs):  # synthetic anchor times: V100 4, 3, 1 ms; P100 2, 6, 1 ms
        asked.append([s.id for s in specs])
        return pd.DataFrame({"pred_ms": [2.0, 6.0, 1.0, 4.0, 3.0, 1.0]})

    out = cap(ROWS, gpus, pred, StubModel(), time_on)
    assert asked == [["p100-pcie-16gb", "v100-pcie-32gb"]]  # both measured, both dominated
    # the A100 (never measured): the add to the P100's 2 ms, its interval halved with it;
    # the mul stays (1 ms is below both); the roofline-timed sdpa has no anchors
    assert out["pred_ms"].tolist()[:3] == [2.0, 1.0, 9.0]
    assert out[["p10_ms", "p90_ms"]].iloc[0].tolist() == [1.0, 4.0]
    assert out["method"].tolist()[:3] == [
        "per-op" + CAP_NOTE.format(gpu="p100-pcie-16gb"),
        "per-op",
        "roofline-calibrated (proxy: gemm)",
    ]
    # the V100 was measured by the head: its own prediction stands
    assert out["pred_ms"].tolist()[3:] == [5.0, 1.0, 9.0]


def test_no_anchor_no_call():
    pred = pd.DataFrame({"pred_ms": [5.0, 1.0, 9.0], "method": "per-op"})
    out = cap(ROWS, [get_gpu("t4")], pred, StubModel(), lambda specs: pytest.fail("called"))
    assert out is pred  # the T4 dominates neither the V100 nor the P100


def _kernel_rows() -> pd.DataFrame:
    frames = [
        pd.DataFrame({"op": "linear", "family": "gemm", "direction": "forward", "b": 1,
                      "m": [1, 64, 512, 4096], "n": 4096, "k": [64, 256, 4096, 4096]}),
        pd.DataFrame({"op": "add", "family": "elementwise", "direction": "forward",
                      "numel": [1, 4096, 2**20, 2**24]}),
        pd.DataFrame({"op": "layer_norm", "family": "norm", "direction": "backward",
                      "rows": [1, 64, 4096], "cols": 1024, "numel": [1024, 65536, 4194304]}),
        pd.DataFrame({"op": "conv2d", "family": "conv", "direction": "forward", "batch": [1, 8, 64],
                      "in_channels": 64, "out_channels": 64, "kernel_size": 3, "input_h": 56,
                      "stride": 1, "padding": 1}),
    ]  # fmt: skip
    both = [f.assign(dtype=d) for f in frames for d in ("float32", "bfloat16")]
    return pd.concat(both, ignore_index=True)


@pytest.mark.parametrize("gpu", ["h100-sxm", "h200", "a100-80gb-sxm", "rtx-4090", "l40s"])
def test_the_packaged_models_time_no_row_slower_than_on_a_measured_gpu_it_dominates(gpu):
    rows, model, gemm = _kernel_rows(), load_model(), load_gemm_model()
    spec = get_gpu(gpu)
    out = time_kernel_rows(rows, spec, model, gemm)
    plain = time_uncapped(rows, [spec], model, gemm)
    measured = {a for head in model.heads.values() for a in head.gpus}
    anchors = [a for a in sorted(measured) if dominates(spec, get_gpu(a))]
    assert anchors, gpu
    lowered = out["pred_ms"].to_numpy() < plain["pred_ms"].to_numpy()
    assert out["method"][lowered].str.contains(r" \(capped at ").all()
    assert not out["method"][~lowered].str.contains("capped").any()
    for anchor in anchors:
        theirs = time_uncapped(rows, [get_gpu(anchor)], model, gemm)["pred_ms"].to_numpy()
        # the rows whose head measured the anchor (each family here has a head of its name)
        measured_by = {f: anchor in model.heads[f].gpus for f in rows["family"].unique()}
        has = rows["family"].map(measured_by).to_numpy(dtype=bool)
        assert (out["pred_ms"].to_numpy()[has] <= theirs[has]).all(), anchor


def test_a_step_is_no_slower_per_op_than_on_a_measured_gpu_it_dominates():
    from boom_ml.timing.per_op import estimate_per_op
    from boom_ml.trace.step import trace_step
    from tests.tiny_models import tiny_transformer

    graph = trace_step(tiny_transformer(), StepSpec(batch_size=8, seq_len=256))
    h100 = estimate_per_op(graph, get_gpu("h100-sxm"))
    for anchor in ("a100-80gb-pcie", "a100-40gb-pcie", "v100-pcie-32gb"):
        assert h100.step_ms <= estimate_per_op(graph, get_gpu(anchor)).step_ms


def test_the_check_scores_a_gpu_against_the_measured_gpus_it_dominates(small_kernels, small_model):  # noqa: F811
    """training/anchor_check on a small real NeuSight subset (tests/test_train_ops.py's
    fixtures; the model is fit on every GPU, so this is in-sample, and its heads measured the
    A100-80GB itself, so nothing of it is capped)."""
    from training.anchor_check import check

    table = check(small_kernels, lambda _gpu: small_model, ["a100-80gb-pcie", "t4"])
    assert set(table["gpu"]) == {"a100-80gb-pcie"}  # the T4 dominates no measured GPU
    assert set(table["anchors"]) == {"a100-40gb-pcie,p100-pcie-16gb,v100-pcie-32gb"}
    assert "all" in set(table["head"])
    assert (table["lowered_pct"] == 0).all()
    assert (table["mape_capped"] == table["mape_uncapped"]).all()
