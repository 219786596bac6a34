"""cuDNN's NCHW<->NHWC transforms around tensor-core convolutions (timing/conv_layout.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.gpus import get_gpu
from boom_ml.specs import StepSpec
from boom_ml.timing import conv_layout
from boom_ml.timing.per_op import node_rows, predict_nodes_many
from tests.test_timing_features import synthetic_node

X, W, Y = [8, 64, 56, 56], [128, 64, 3, 3], [8, 128, 28, 28]
FWD = synthetic_node("cudnn_convolution", "conv", [X, W], [Y], dtype="float16")
BWD = {**synthetic_node("convolution_backward", "conv", [Y, X, W], [X, W], dtype="float16"),
       "phase": "backward"}  # fmt: skip
FP32 = synthetic_node("cudnn_convolution", "conv", [X, W], [Y])
DEPTHWISE = synthetic_node("cudnn_convolution", "conv", [X, [64, 1, 3, 3]], [[8, 64, 56, 56]],
                           dtype="float16")  # fmt: skip
NODES = pd.DataFrame([FWD, BWD, FP32, DEPTHWISE])
N = {"x": 8 * 64 * 56 * 56, "w": 128 * 64 * 3 * 3, "y": 8 * 128 * 28 * 28}


def test_each_operand_of_an_fp16_kernel_is_read_and_written_once() -> None:
    rows = node_rows(NODES)  # NCHW (PyTorch's default layout)
    layout = rows[rows[conv_layout.MARK].notna()]
    # forward: x, w, y; backward input-grad: dy, w, dx; weight-grad: x, dy, dw. fp32 (the
    # default math type) and depthwise convolutions: none.
    assert list(layout["node_pos"]) == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    expected = [N["x"], N["w"], N["y"], N["y"], N["w"], N["x"], N["x"], N["y"], N["w"]]
    assert list(layout["bytes_read"]) == [2.0 * n for n in expected]  # fp16: 2 bytes each
    assert list(layout["bytes_written"]) == [2.0 * n for n in expected]
    assert set(layout["family"]) == {"copy"} and set(layout["dtype"]) == {"float16"}
    kernels = rows[rows[conv_layout.MARK].isna()]
    assert list(kernels["op"]) == ["conv2d"] * 5 and list(kernels["node_pos"]) == [0, 1, 1, 2, 3]
    assert conv_layout.MARK not in node_rows(NODES, channels_last=True)


@pytest.mark.parametrize(
    ("gpu", "fp16", "bf16"),
    [("p100-pcie-16gb", False, False), ("v100-pcie-32gb", True, False), ("t4", True, False),
     ("a100-80gb-pcie", True, True), ("h100-sxm", True, True)],
)  # fmt: skip
def test_tensor_cores_by_architecture(gpu: str, fp16: bool, bf16: bool) -> None:
    spec = get_gpu(gpu)
    assert conv_layout.on_tensor_cores("float16", spec) is fp16
    assert conv_layout.on_tensor_cores("bfloat16", spec) is bf16
    assert conv_layout.on_tensor_cores("float32", spec) is False


def test_nchw_costs_the_transforms_only_where_tensor_cores_run() -> None:
    gpus = [get_gpu("rtx-3090"), get_gpu("p100-pcie-16gb")]
    nchw = predict_nodes_many(NODES, gpus, median_only=True)
    nhwc = predict_nodes_many(NODES, gpus, median_only=True, channels_last=True)
    # RTX 3090: the fp16 convolutions pay their transforms; fp32 and depthwise do not.
    assert (nchw["ms"][0, :2] > nhwc["ms"][0, :2]).all()
    np.testing.assert_array_equal(nchw["ms"][0, 2:], nhwc["ms"][0, 2:])
    # P100 (no tensor cores): the layouts cost the same; the kernel still names the method.
    np.testing.assert_array_equal(nchw["ms"][1], nhwc["ms"][1])
    assert list(nchw["method"][0]) == list(nhwc["method"][0])


def test_channels_last_is_a_step_option() -> None:
    assert StepSpec(channels_last=True).to_dict()["channels_last"] is True
    with pytest.raises(InvalidInputError, match="channels_last must be true or false"):
        StepSpec(channels_last="yes")


def test_layout_check_pairs_the_two_layouts_of_one_configuration() -> None:
    from training.layout_check import paired_ratios, summary

    synthetic = pd.DataFrame({  # synthetic rows: two models, one measured in one layout only
        "model": ["a", "a", "b", "b", "c"], "batch_size": [8, 8, 4, 4, 2],
        "family": ["cnn", "cnn", "transformer", "transformer", "cnn"],
        "channels_last": [False, True, False, True, False],
        "target_ms": [100.0, 80.0, 50.0, 50.0, 7.0], "baseline_ms": [90.0, 81.0, 40.0, 42.0, 6.0],
    })  # fmt: skip
    pairs = paired_ratios(synthetic).set_index("model")
    assert list(pairs.index) == ["a", "b"]
    assert pairs.loc["a", "measured"] == pytest.approx(0.8)
    assert pairs.loc["a", "predicted"] == pytest.approx(0.9)
    assert pairs.loc["b", "predicted"] == pytest.approx(1.05)
    table = summary(paired_ratios(synthetic))
    assert table.loc["all", "pairs"] == 2 and table.loc["cnn", "measured"] == 0.8


def test_the_traced_step_carries_the_layout_to_its_time(monkeypatch) -> None:
    from boom_ml.timing import estimate
    from boom_ml.trace.step import trace_step
    from tests.tiny_models import tiny_cnn

    monkeypatch.setattr(estimate, "load_weights", lambda: None)  # the per-op sum alone
    gpus = [get_gpu("rtx-3090"), get_gpu("p100-pcie-16gb")]
    times = {}
    for cl in (False, True):
        spec = StepSpec(batch_size=8, image_size=32, optimizer="sgd", amp="fp16", channels_last=cl)
        graph = trace_step(tiny_cnn(), spec)
        assert graph.meta["step"]["channels_last"] is cl
        times[cl] = [e.step_ms for e in estimate.estimate_times(graph, gpus)]
    assert times[False][0] > times[True][0]  # autocast's fp16 convolutions on tensor cores
    assert times[False][1] == pytest.approx(times[True][1])  # Pascal: no tensor cores


def test_the_gnn_reads_nhwc_only_where_half_precision_convolutions_run() -> None:
    """Every channels_last step the GNN trained on ran under AMP: an fp32 step in NHWC, whose
    per-op times equal the NCHW step's, gets the NCHW step's context (the GNN would otherwise
    move an fp32 P100 step on a flag it never saw in that setting); under AMP the flag counts."""
    import numpy as np

    from boom_ml.timing.gnn_features import gpu_context
    from boom_ml.trace.step import trace_step
    from tests.tiny_models import tiny_cnn

    gpu = get_gpu("t4")
    flag = {}
    for amp in ("none", "fp16"):
        spec = StepSpec(batch_size=8, image_size=32, optimizer="sgd", amp=amp, channels_last=True)
        graph = trace_step(tiny_cnn(), spec)
        context = [gpu_context(graph, gpu, None, np.ones(len(graph.nodes)), cl) for cl in (0, 1)]
        flag[amp] = context[1] - context[0]
    assert not flag["none"].any()
    assert flag["fp16"].sum() == 1.0  # the one channels_last input, set
