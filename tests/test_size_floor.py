"""The size floor: an op is never timed faster than the same op on one element.

The rows in the first tests are synthetic (made-up sizes) and the predictor is a stub whose
time falls with size, so that every expected floor is exact; the later tests use the packaged
per-op model, and the last a small model fit on a real NeuSight subset (its measurements).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_train_ops import data_dir, small_kernels, small_model  # noqa: F401

from boom_ml.gpus import get_gpu
from boom_ml.specs import StepSpec
from boom_ml.timing.anchors import time_kernel_rows
from boom_ml.timing.features import kernel_features
from boom_ml.timing.gemm import load_gemm_model
from boom_ml.timing.heads import load_model
from boom_ml.timing.per_op import predict_nodes_many
from boom_ml.timing.size_floor import SizeFloor, smallest_rows

ROWS = pd.DataFrame(
    [
        {"op": "add", "family": "elementwise", "dtype": "float32", "direction": "forward",
         "numel": 12, "rows": 1, "cols": 12},
        {"op": "rms_norm", "family": "norm", "dtype": "float32", "direction": "backward",
         "numel": 10240, "rows": 5, "cols": 2048},
        {"op": "linear", "family": "gemm", "dtype": "float32", "direction": "forward",
         "b": 1, "m": 64, "n": 64, "k": 64},
        {"op": "relu", "family": "elementwise", "dtype": "float32", "direction": "forward",
         "numel": 1, "rows": 1, "cols": 1},
        {"op": "_foreach_add_", "family": "optimizer", "dtype": "float32", "direction": "forward",
         "numel": 5, "arity": 2, "flops": 10.0, "bytes": 60.0},
    ]
)  # fmt: skip


def test_streams_are_cut_to_one_element_and_row_wise_ops_to_one_row():
    small, source = smallest_rows(ROWS)
    assert source.tolist() == [0, 1, 4]  # the GEMM and the one-element row: no copy
    assert small["numel"].tolist() == [1, 2048, 1]
    assert small["rows"].tolist()[:2] == [1, 1] and small["cols"].tolist()[:2] == [1, 2048]
    # a node's own counts follow its elements: 12 bytes and 2 FLOPs per element
    assert (small["bytes"].iloc[2], small["flops"].iloc[2]) == pytest.approx((12, 2))
    assert small["op"].tolist() == ["add", "rms_norm", "_foreach_add_"]
    assert small["direction"].tolist() == ["forward", "backward", "forward"]


class FallingWithSize:
    """Stub predictor (synthetic): 10 ms minus log2 of the elements, a time that falls as
    the tensor grows, as the packaged fp32 elementwise head did on GPUs faster than any
    measured one."""

    def predict_features(self, feats: pd.DataFrame, median_only: bool = False) -> pd.DataFrame:
        ms = 10.0 - feats["log_numel"].to_numpy()
        return pd.DataFrame({"pred_ms": ms, "p10_ms": ms, "p90_ms": ms})


CONV = {"op": "conv2d", "family": "conv", "dtype": "bfloat16", "in_channels": 64,
        "out_channels": 64, "kernel_size": 3, "input_h": 56, "stride": 1, "padding": 1}  # fmt: skip


def test_a_convolution_is_cut_to_one_image():
    rows = pd.DataFrame([{**CONV, "direction": "forward", "batch": 8, "flops": 8e9, "bytes": 8e6},
                         {**CONV, "direction": "backward", "grad_wrt": "weight", "batch": 32},
                         {**CONV, "direction": "forward", "batch": 1}])  # fmt: skip
    small, source = smallest_rows(rows)
    assert source.tolist() == [0, 1]  # the batch-1 row has no copy
    assert small["batch"].tolist() == [1, 1]
    assert small["grad_wrt"].tolist()[1] == "weight" and small["input_h"].tolist() == [56, 56]
    assert (small["flops"].iloc[0], small["bytes"].iloc[0]) == (1e9, 1e6)


@pytest.mark.parametrize("gpu", ["b200", "h100-sxm", "a100-40gb-pcie", "t4"])
def test_the_packaged_model_times_no_convolution_below_one_image(gpu):
    # resnet50's 3x3 and 1x1 convolutions, bf16: on a B200 a batch-1 64->64 3x3 conv took
    # 0.031 ms and the same conv at batch 4 0.014 before the floor
    shapes = [(64, 64, 3, 56), (256, 64, 1, 56), (512, 512, 3, 7), (3, 64, 7, 224)]
    model = load_model()
    for c, o, k, h in shapes:
        for direction, wrt in (("forward", None), ("backward", "input"), ("backward", "weight")):
            rows = pd.DataFrame({**CONV, "in_channels": c, "out_channels": o, "kernel_size": k,
                                 "input_h": h, "padding": k // 2, "direction": direction,
                                 "grad_wrt": wrt, "batch": [1, 2, 4, 8, 16, 32, 64]})  # fmt: skip
            out = model.predict_rows(rows, get_gpu(gpu))
            ms = out["pred_ms"].to_numpy()
            assert (ms >= ms[0]).all(), (c, o, k, h, direction, ms)
            plain = model.predict_features(kernel_features(rows, get_gpu(gpu)))["pred_ms"]
            raised = ms > plain.to_numpy()
            assert (out["method"][raised] == "per-op (one-image floor)").all()
            assert (out["method"][~raised] == "per-op").all()


def test_a_row_is_raised_to_its_one_element_copy_and_says_so():
    rows = ROWS.iloc[[0, 2, 3]].reset_index(drop=True)
    pred = pd.DataFrame({"pred_ms": [2.0, 0.5, 4.0], "p10_ms": [1.0, 0.4, 3.0],
                         "p90_ms": [4.0, 0.6, 5.0], "method": "per-op"})  # fmt: skip
    out = SizeFloor.of(rows, get_gpu("h100-sxm")).lift(pred, FallingWithSize())
    times = out[["pred_ms", "p10_ms", "p90_ms"]]
    # the add's one-element copy takes 10 ms: five times its own 2 ms, interval with it
    assert times.loc[0].tolist() == pytest.approx([10.0, 5.0, 20.0])
    assert times.loc[1].tolist() == [0.5, 0.4, 0.6]  # a GEMM: not floored
    assert times.loc[2].tolist() == [4.0, 3.0, 5.0]  # nothing smaller than one element
    assert out["method"].tolist() == ["per-op (one-element floor)", "per-op", "per-op"]


SIZES = [4**k for k in range(14)]


@pytest.mark.parametrize("gpu", ["h100-sxm", "b200", "a100-40gb-pcie", "t4"])
def test_the_packaged_model_times_no_op_below_its_one_element_time(gpu):
    # An fp32 add on an H100 SXM took 26.5 us on one element and 18.2 on 2^20 before the floor.
    frames = []
    for dtype in ("float32", "bfloat16"):
        for op in ("add", "gelu", "mul_scalar"):
            frames.append(pd.DataFrame({"op": op, "family": "elementwise", "dtype": dtype,
                                        "direction": "forward", "numel": SIZES}))  # fmt: skip
        for op, family in (("rms_norm", "norm"), ("layer_norm", "norm"), ("softmax", "softmax")):
            for direction in ("forward", "backward"):
                frames.append(pd.DataFrame({"op": op, "family": family, "dtype": dtype,
                                            "direction": direction, "rows": SIZES[:9], "cols": 2048,
                                            "numel": [s * 2048 for s in SIZES[:9]]}))  # fmt: skip
    model = load_model()
    for frame in frames:
        ms = model.predict_rows(frame, get_gpu(gpu))["pred_ms"].to_numpy()
        assert (ms >= ms[0]).all(), (frame["op"].iloc[0], frame["dtype"].iloc[0], ms)
    add = frames[0]  # fp32 add, sizes 4^0 ... 4^13
    plain = model.predict_features(kernel_features(add, get_gpu(gpu)))["pred_ms"].to_numpy()
    floored = model.predict_rows(add, get_gpu(gpu))["pred_ms"].to_numpy()
    assert (floored == np.maximum(plain, plain[0])).all()


def test_a_traced_step_times_each_sized_node_at_least_at_its_one_element_time():
    from boom_ml.timing.per_op import node_rows
    from boom_ml.trace.step import trace_step
    from tests.tiny_models import tiny_transformer

    graph = trace_step(tiny_transformer(), StepSpec(batch_size=64, seq_len=512))
    gpus = [get_gpu("h100-sxm"), get_gpu("b200")]
    ms = predict_nodes_many(graph.nodes, gpus, median_only=True)["ms"]
    rows = node_rows(graph.nodes)
    small, source = smallest_rows(rows.drop(columns=["node_pos"]))
    pos = rows["node_pos"].to_numpy()[source]
    assert len(np.unique(pos)) > 20  # the step's elementwise, norm, softmax and optimizer nodes
    model, gemm = load_model(), load_gemm_model()
    for k, gpu in enumerate(gpus):
        # the one-element copies as a step times them: the H100 is capped at the measured GPUs
        # it dominates (anchors.py) at every size alike, so its floor is the capped one
        one = time_kernel_rows(small, gpu, model, gemm)["pred_ms"].to_numpy()
        assert (ms[k, pos] >= one - 1e-12).all()


def test_a_raised_interval_keeps_each_side_on_its_side():
    # where a side equalled the median, its scaled copy rounded across the raised median
    rows = pd.DataFrame({"op": ["add", "where"], "family": "elementwise", "dtype": ["float32", "bfloat16"],
                         "direction": "forward", "numel": [23170, 16384]})  # fmt: skip
    pred = load_model().predict_rows(rows, get_gpu("p4"))
    assert (pred["p10_ms"] <= pred["pred_ms"]).all() and (pred["pred_ms"] <= pred["p90_ms"]).all()


def test_the_check_scores_both_floors_on_real_rows(small_kernels, small_model):  # noqa: F811
    """training/size_floor_check on a small real NeuSight subset (tests/test_train_ops.py's
    fixtures; the model is fit on every GPU, so this is in-sample): the first version's floor
    takes in the one-element copy, so it raises every row the shipped floor raises."""
    from training.size_floor_check import check

    table = check(small_kernels, lambda _gpu: small_model, ["t4", "v100-pcie-32gb"])
    assert set(table["gpu"]) == {"t4", "v100-pcie-32gb"}
    assert set(table["head"]) == {"elementwise", "norm", "softmax", "conv"}
    sized = table[table["head"] != "conv"]
    assert (sized["raised_every_size_pct"] >= sized["raised_floor_pct"]).all()
    assert sized[["mape_heads", "mape_floor", "mape_every_size"]].gt(0).all().all()
    conv = table[table["head"] == "conv"]  # one-image floor: no first version to compare
    assert (conv["mape_every_size"] == "-").all() and conv["mape_floor"].gt(0).all()
