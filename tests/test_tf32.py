"""PyTorch's two TF32 switches: cuDNN (on by default) for convolutions, matmul (off) for GEMMs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from boom_ml.gpus import get_gpu
from boom_ml.timing.features import kernel_features
from boom_ml.timing.per_op import node_rows
from boom_ml.timing.roofline import roofline_ms
from boom_ml.timing.tf32 import Tf32, from_torch_version
from tests.test_timing_features import synthetic_node
from training.step_traces import row_tf32

CONV = synthetic_node("cudnn_convolution", "conv", [[8, 64, 56, 56], [128, 64, 3, 3]],
                      [[8, 128, 28, 28]])  # fmt: skip
LINEAR = synthetic_node("addmm", "gemm", [[256], [4096, 1024], [1024, 256]], [[4096, 256]])
SDPA = synthetic_node("_scaled_dot_product_efficient_attention", "attention",
                      [[2, 4, 128, 64]] * 3, [[2, 4, 128, 64]])  # fmt: skip
HALF_CONV = synthetic_node("cudnn_convolution", "conv", [[8, 64, 56, 56], [128, 64, 3, 3]],
                           [[8, 128, 28, 28]], dtype="float16")  # fmt: skip
NODES = pd.DataFrame([CONV, LINEAR, SDPA, HALF_CONV])


@pytest.mark.parametrize(
    ("tf32", "dtypes"),
    [
        (None, ["tf32", "float32", "float32", "float16"]),  # PyTorch's defaults
        (Tf32(), ["tf32", "float32", "float32", "float16"]),
        (True, ["tf32", "tf32", "tf32", "float16"]),  # tf32=true: both switches
        (False, ["float32", "float32", "float32", "float16"]),
        (Tf32(matmul=True, cudnn=False), ["float32", "tf32", "tf32", "float16"]),
    ],
)
def test_each_node_follows_its_family_switch(tf32, dtypes):
    # channels_last: no layout-transform rows beside the fp16 convolution (test_conv_layout)
    assert list(node_rows(NODES, tf32=tf32, channels_last=True)["dtype"]) == dtypes


def test_of_and_versions():
    assert Tf32.of(None) == Tf32(matmul=False, cudnn=True)
    assert Tf32.of(True) == Tf32(True, True) and Tf32.of(False) == Tf32(False, False)
    assert from_torch_version("1.7") == Tf32(True, True)
    assert from_torch_version("1.11.0") == Tf32(True, True)
    assert from_torch_version("1.12") == Tf32(False, True)
    assert from_torch_version("2.1.0") == Tf32(False, True)
    assert from_torch_version("1.6.0") == Tf32(False, False)


def test_roofline_uses_tf32_peak_only_where_the_switch_is_on():
    nodes = pd.DataFrame([{**CONV, "flops": 1e12}, {**LINEAR, "flops": 1e12}])
    a100 = get_gpu("a100-80gb-pcie")
    ms = roofline_ms(nodes, a100)  # defaults: conv on TF32, linear fp32
    assert ms[0] == pytest.approx(1e12 / (a100.tf32_tflops * 1e12) * 1e3 + 0.005)
    assert ms[1] == pytest.approx(1e12 / (a100.fp32_tflops * 1e12) * 1e3 + 0.005)
    # Before Ampere the switches change nothing.
    v100 = get_gpu("v100-pcie-32gb")
    np.testing.assert_array_equal(roofline_ms(nodes, v100, True), roofline_ms(nodes, v100, False))


def test_tf32_row_on_a_gpu_without_tf32_is_an_fp32_row():
    rows = node_rows(pd.DataFrame([CONV]), tf32=True).drop(columns=["node_pos"])
    fp32 = rows.assign(dtype="float32")
    v100 = get_gpu("v100-pcie-32gb")
    pd.testing.assert_frame_equal(kernel_features(rows, v100), kernel_features(fp32, v100))
    a100 = get_gpu("a100-80gb-pcie")
    assert (
        kernel_features(rows, a100)["roof_ms"].iloc[0]
        < kernel_features(fp32, a100)["roof_ms"].iloc[0]
    )


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"source": "cnn_step_times", "tf32": None, "torch_version": None}, Tf32(True, True)),
        ({"source": "cnn_step_times", "tf32": False, "torch_version": None}, Tf32(False, False)),
        ({"source": "timm_train", "tf32": None, "torch_version": "1.12"}, Tf32(False, True)),
        ({"source": "neusight_labels", "tf32": None, "torch_version": None}, Tf32(False, True)),
        ({"source": "ours", "tf32": True, "torch_version": "2.14.1"}, Tf32(True, True)),
    ],
)
def test_training_rows_follow_the_measuring_release(row, expected):
    assert row_tf32(pd.Series(row)) == expected


@pytest.mark.parametrize(
    ("kw", "switches"),
    [
        ({}, (False, True)),  # PyTorch's defaults
        ({"tf32": True}, (True, True)),
        ({"tf32_cudnn": False}, (False, False)),
        ({"tf32": True, "tf32_matmul": False}, (False, True)),
        ({"tf32_matmul": True}, (True, True)),
    ],
)
def test_step_spec_switches(kw, switches):
    from boom_ml.specs import StepSpec

    assert StepSpec(**kw).tf32_switches() == switches


def test_cli_checks_the_switches():
    from boom_ml.errors import InvalidInputError
    from boom_ml.predict import validate

    assert (
        validate({"model": "torchvision:resnet18", "gpu": "l4", "tf32_cudnn": False})["tf32_cudnn"]
        is False
    )
    # a switch's words are its bools on the command line (tf32_cudnn=off)
    base = {"model": "torchvision:resnet18", "gpu": "l4"}
    assert [validate({**base, "tf32_matmul": w})["tf32_matmul"] for w in ("yes", "Off")] == [
        True,
        False,
    ]
    with pytest.raises(InvalidInputError, match="tf32_matmul must be true or false, got 'yess'"):
        validate({**base, "tf32_matmul": "yess"})


@pytest.mark.parametrize(
    ("step", "label"),
    [
        ({"tf32": False}, ""),  # PyTorch's defaults: matmuls off, cuDNN on
        ({"tf32": True}, "  tf32"),
        ({"tf32": False, "tf32_matmul": True}, "  tf32"),
        ({"tf32": False, "tf32_cudnn": False}, "  no-tf32-cudnn"),
        ({"tf32": True, "tf32_cudnn": False}, "  tf32-matmul  no-tf32-cudnn"),
    ],
)
def test_the_table_title_names_switches_off_pytorchs_defaults(step, label):
    from boom_ml.report.table import _tf32_label

    assert _tf32_label(step) == label


def test_a_step_with_tf32_is_never_slower_than_in_strict_fp32():
    """resnet50 batch 32 on an L4 came out 163.2 ms with cuDNN's TF32 and 151.4 without: where
    the learned models put TF32 above strict fp32, the strict estimate is the step's and says
    so; elsewhere TF32's own stays. A GPU without TF32 (a T4) is not compared."""
    import boom_ml
    from boom_ml.report.table import render_table

    kw = dict(model="torchvision:resnet50", batch_size=32, advice=False, max_batch="off")
    gpus = ["l4", "l40s", "a100-80gb-sxm", "h100-sxm", "t4"]
    on = boom_ml.predict(gpu=gpus, **kw)
    off = boom_ml.predict(gpu=gpus, tf32_cudnn=False, **kw)
    capped = []
    for a, b in zip(on.gpus, off.gpus, strict=True):
        assert a.time.step_ms <= b.time.step_ms, a.gpu
        assert a.time.tf32_capped == (a.time.step_ms == b.time.step_ms and a.gpu != "t4")
        capped += [a.gpu] if a.time.tf32_capped else []
    assert "l4" in capped and "a100-80gb-sxm" not in capped and not off.gpus[0].time.tf32_capped
    # the default's switch is named: cuDNN's, on in PyTorch unless turned off
    assert (
        f"TF32 on {', '.join(capped)}: with cuDNN's TF32 (tf32_cudnn, on by default as in"
        " PyTorch) the step came out slower"
    ) in render_table(on)
