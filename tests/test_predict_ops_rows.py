"""predict_ops on rows a helper's hunt found mistimed: convolution gradients of no elements,
and which rows of a measured GPU no GPU of its architecture measured in fp16."""

from __future__ import annotations

import warnings

import pandas as pd

from boom_ml.predict_ops import predict_ops


def test_a_convolution_gradient_of_no_elements_is_empty_and_quiet() -> None:
    """in_channels 0 leaves both gradients without elements, batch 0 the input's and
    out_channels 0 the weight's; they had been timed above the full-size kernel (0.28 ms
    against 0.11), with numpy's divide warning on the terminal. A weight gradient at batch
    0 and an input gradient with no output channels have elements, and are timed."""
    shape = [(32, 0, 64, "input"), (32, 0, 64, "weight"), (0, 64, 64, "input"),
             (32, 64, 0, "weight"), (0, 64, 64, "weight"), (32, 64, 0, "input")]  # fmt: skip
    table = pd.DataFrame(shape, columns=["batch", "in_channels", "out_channels", "grad_wrt"])
    table = table.assign(op="conv2d", kernel_size=3, input_h=56, direction="backward",
                         dtype="fp16")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = predict_ops(table, "a100-80gb-sxm")
    assert list(out["method"].iloc[:4]) == ["empty"] * 4
    assert list(out["pred_ms"].iloc[:4]) == [0.0] * 4
    assert (out["pred_ms"].iloc[4:] > 0).all()


def test_a_half_precision_rows_basis_is_its_kind_in_fp16() -> None:
    """An L4 has fp32 GEMM and convolution rows of its own and no Ada GPU fp16 ones: its fp16
    rows had said "measured" beside the note that says otherwise (a hunt). A T4's fp16
    convolutions are its own (DeepBench); an RTX 4090's fp32 ones are its architecture's."""
    from boom_ml.predict_ops import notes

    table = pd.DataFrame({"op": ["conv2d", "conv2d", "bmm"], "batch": [32, 32, None],
                          "in_channels": [64, 64, None], "out_channels": [64, 64, None],
                          "kernel_size": [3, 3, None], "input_h": [56, 56, None],
                          "b": [None, None, 8], "m": [None, None, 512], "n": [None, None, 64],
                          "k": [None, None, 512], "dtype": ["fp16", "fp32", "fp16"]})  # fmt: skip
    basis = {gpu: list(predict_ops(table, gpu)["basis"]) for gpu in ("l4", "t4", "rtx-4090")}
    assert basis == {
        "l4": ["architecture not measured", "measured", "architecture not measured"],
        "t4": ["measured", "measured", "measured"],
        "rtx-4090": ["architecture not measured", "architecture measured",
                     "architecture not measured"],
    }  # fmt: skip
    assert any("fp16/bf16 GEMMs or convolutions measured" in n for n in notes(table, "l4"))
    # attention is the GEMM head's calibration of its roofline: its fp16 rows follow the
    # head's fp16 coverage (an L4's had said "measured", a hunt), its fp32 rows the GPU's
    attn = pd.DataFrame({"op": ["sdpa", "sdpa"], "batch": [8, 8], "heads": [12, 12],
                         "seq_q": [512, 512], "head_dim": [64, 64], "dtype": ["fp16", "fp32"]})  # fmt: skip
    out = predict_ops(attn, "l4")
    assert list(out["method"]) == ["roofline-calibrated (proxy: gemm)"] * 2
    assert list(out["basis"]) == ["architecture not measured", "measured"]


def test_a_bad_causal_or_grad_wrt_names_its_row() -> None:
    """In a long CSV the row is what the user needs; these four errors had named none."""
    import pytest

    from boom_ml.errors import InvalidInputError

    conv = {"op": "conv2d", "batch": 8, "in_channels": 16, "out_channels": 16,
            "kernel_size": 3, "input_h": 14}  # fmt: skip
    attn = {"op": "sdpa", "batch": 1, "heads": 2, "seq_q": 64, "head_dim": 32}
    cases = [
        ([attn, {**attn, "causal": 2}], r"causal must be 0 or 1 \(row 2: 2\)"),
        ([conv, {**conv, "causal": 1}], r"attention \(sdpa\) rows only \(row 2: 'conv2d'\)"),
        ([{**conv, "direction": "backward", "grad_wrt": "bias"}],
         r"grad_wrt must be input or weight \(row 1: 'bias'\)"),
        ([conv, {**conv, "grad_wrt": "input"}], r"backward conv rows only \(row 2: 'conv2d'\)"),
        ([conv, conv, {**conv, "direction": "backward"}], r"give one row each; row 3: 'conv2d'\)"),
    ]  # fmt: skip
    for rows, message in cases:
        with pytest.raises(InvalidInputError, match=message):
            predict_ops(pd.DataFrame(rows), "l4")
