"""predict_ops: CSV validation (one clear line, exit 2) and predictions with a real model."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

# Real-data fixtures (a small NeuSight subset and a tiny model trained on it).
from test_train_ops import data_dir, small_kernels, small_model, small_model_dir  # noqa: F401

from boom_ml.errors import InvalidInputError
from boom_ml.ops_csv import canonical_rows
from boom_ml.predict_ops import predict_ops, run

REPO = Path(__file__).resolve().parent.parent
PACKAGED = REPO / "boom_ml" / "artifacts" / "per_op" / "model.json"


def test_missing_shape_column_is_one_clear_error():
    with pytest.raises(
        InvalidInputError, match=r"missing column\(s\) for gemm ops \(bmm, row 1\): k"
    ):
        canonical_rows(pd.DataFrame({"op": ["bmm"], "B": [1], "M": [64], "N": [64]}))


def test_unknown_column_and_unknown_op_are_rejected():
    with pytest.raises(InvalidInputError, match="unknown column"):
        canonical_rows(
            pd.DataFrame({"op": ["bmm"], "B": [1], "M": [2], "N": [3], "K": [4], "Q": [5]})
        )
    with pytest.raises(InvalidInputError, match="unknown op 'frobnicate'"):
        canonical_rows(pd.DataFrame({"op": ["frobnicate"], "numel": [10]}))
    with pytest.raises(InvalidInputError, match="missing column: op"):
        canonical_rows(pd.DataFrame({"B": [1]}))


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ({"op": ["bmm", "linear"], "B": [1, 1], "M": [2, 2], "N": [3, 3], "K": [4, None]},
         "input: row 2 (linear) leaves column k empty; gemm ops need m, n, k"),
        ({"op": ["linear", "linear"], "M": [2, "a"], "N": [3, 3], "K": [4, 4]},
         "input: column m must hold non-negative whole numbers (row 2: 'a')"),
        ({"op": ["addd"], "numel": [10]}, "input: unknown op 'addd' (row 1) (did you mean: add"),
    ],
)  # fmt: skip
def test_a_bad_cell_names_its_row(frame, message):
    with pytest.raises(InvalidInputError) as err:
        canonical_rows(pd.DataFrame(frame))
    assert str(err.value).startswith(message) and "known:" not in str(err.value)


def test_neusight_conventions_map_to_canonical_rows():
    rows = canonical_rows(pd.DataFrame({
        "op": ["linear", "softmax", "addu", "conv2d"][:3],
        "B": [2, 8, 8], "M": [128, None, None], "N": [512, None, None], "K": [256, None, None],
        "H": [None, 1024, 1024], "dtype": ["fp16", None, "fp32"],
    }))  # fmt: skip
    assert list(rows["family"]) == ["gemm", "softmax", "elementwise"]
    assert rows.loc[2, "op"] == "add_scalar"  # NeuSight's "u": a Python-scalar operand
    assert rows.loc[1, "rows"] == 8 and rows.loc[1, "cols"] == 1024 and rows.loc[1, "numel"] == 8192
    assert list(rows["dtype"]) == ["float16", "float32", "float32"]


def test_numel_with_one_side_gives_the_other():
    """A hunt: a layer norm given rows=4096 and numel=4194304 was timed as one row of 4194304
    (cols took numel); the other side is now the quotient, and one that does not divide is
    refused."""
    frame = pd.DataFrame({"op": ["layer_norm", "layer_norm", "add"], "rows": [4096, np.nan, np.nan],
                          "cols": [np.nan, 1024, np.nan], "numel": [4194304, 4194304, 1024]})  # fmt: skip
    out = canonical_rows(frame)
    assert out[["rows", "cols"]].to_numpy().tolist() == [[4096, 1024], [4096, 1024], [1, 1024]]
    with pytest.raises(InvalidInputError, match="numel 1024 and rows 3, which does not divide it"):
        canonical_rows(pd.DataFrame({"op": ["add"], "rows": [3], "numel": [1024]}))


def test_rows_pytorch_could_not_run_are_refused(tmp_path):
    """Sizes that are no whole count, and convolutions PyTorch refuses (channels the groups do
    not divide; a kernel larger than the padded input, no output): one error each, not a
    time. An output file that cannot be written is one line too."""
    for size in (float("inf"), 2.5):
        with pytest.raises(InvalidInputError, match="column m must hold non-negative whole"):
            canonical_rows(pd.DataFrame({"op": ["bmm"], "B": [1], "M": [size], "N": [3], "K": [4]}))
    conv = {"op": ["conv2d"], "batch": [32], "in_channels": [64], "out_channels": [64],
            "kernel_size": [3], "input_h": [56], "padding": [1], "groups": [1]}  # fmt: skip
    canonical_rows(pd.DataFrame(conv))
    at_least = "kernel size and stride must be at least 1"
    for change, why in (({"out_channels": [63], "groups": [2]}, "groups must divide"),
                        ({"kernel_size": [7], "input_h": [5], "padding": [0]}, "kernel larger"),
                        # a hunt: a stride of 0 was timed inf ms, a kernel of 0 3x a 3x3
                        ({"stride": [0]}, at_least), ({"kernel_size": [0]}, at_least),
                        # a hunt: groups=0 printed numpy's warning before the error
                        ({"groups": [0]}, "groups must be at least 1")):  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no RuntimeWarning on the way
            with pytest.raises(InvalidInputError, match=f"convolution row 1: {why}"):
                canonical_rows(pd.DataFrame({**conv, **change}))
    (tmp_path / "ops.csv").write_text("op,B,M,N,K\nbmm,1,64,64,64\n")
    with pytest.raises(InvalidInputError, match="not a file in an existing directory"):
        run(
            {
                "input": str(tmp_path / "ops.csv"),
                "gpu": "l4",
                "output": str(tmp_path / "no" / "x.csv"),
            }
        )


@pytest.mark.parametrize(
    "csv, message",
    [("op,B,M,N\nbmm,1,64,64\n", "missing column(s) for gemm ops (bmm, row 1): k"),
     ("op,B,M,N,K,colour\nbmm,1,64,64,64,red\n", "unknown column(s): colour"),
     # a hunt's: pandas read the extra field's row with its op as the index (a traceback)
     ("op,B,M,N,K\nbmm,8,512,64,512,99\n", "a row has more fields than the header"),
     ("op,B,M,N,K\nbmm,8,512,64,512\n,8,512,64,512\n", "row 2 has no op")],
)  # fmt: skip
def test_cli_prints_one_line_and_exits_2(tmp_path, csv, message):
    path = tmp_path / "ops.csv"
    path.write_text(csv)
    proc = subprocess.run([sys.executable, "-m", "boom_ml.predict_ops", f"input={path}", "gpu=l4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("error: ")


def test_predict_ops_with_a_trained_model(small_model_dir, tmp_path):  # noqa: F811
    table = pd.DataFrame({"op": ["bmm", "linear", "layer_norm", "sdpa"], "B": [8, 4, None, None],
                          "M": [512, 1024, None, None], "N": [64, 1024, None, None],
                          "K": [512, 4096, None, None], "rows": [None, None, 4096, None],
                          "cols": [None, None, 1024, None], "batch": [None, None, None, 2],
                          "heads": [None, None, None, 12], "seq_q": [None, None, None, 1024],
                          "head_dim": [None, None, None, 64]})  # fmt: skip
    out = predict_ops(table, "a100-80gb-pcie", model=str(small_model_dir))
    assert (out["pred_ms"] > 0).all()
    assert (out["p10_ms"] <= out["pred_ms"]).all() and (out["pred_ms"] <= out["p90_ms"]).all()
    assert list(out["method"]) == [
        "per-op",
        "per-op",
        "per-op",
        "roofline-calibrated (proxy: gemm)",
    ]
    src = tmp_path / "in.csv"
    table.to_csv(src, index=False)
    run(
        {
            "input": str(src),
            "gpu": "l4",
            "output": str(tmp_path / "out.csv"),
            "model": str(small_model_dir),
        }
    )
    written = pd.read_csv(tmp_path / "out.csv")
    assert {"pred_ms", "p10_ms", "p90_ms", "method", "basis"} <= set(written.columns)


@pytest.mark.skipif(not PACKAGED.exists(), reason="no packaged per-op model")
def test_packaged_model_predicts_a_large_gemm_sensibly():
    # 4096^3 fp32 GEMM on an A100: 137 GFLOP at 19.5 TFLOPS peak is >= 7 ms; sane <= 3x that.
    table = pd.DataFrame({"op": ["mm"], "M": [4096], "N": [4096], "K": [4096]})
    ms = float(predict_ops(table, "a100-80gb-pcie")["pred_ms"].iloc[0])
    assert 7.0 <= ms <= 21.0
    assert np.isfinite(ms)


def test_estimate_per_op_sums_per_op_predictions(small_model):  # noqa: F811
    from tiny_models import tiny_transformer

    from boom_ml.gpus import get_gpu
    from boom_ml.specs import StepSpec
    from boom_ml.timing.per_op import estimate_per_op, predict_nodes
    from boom_ml.trace.step import trace_step

    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2, seq_len=16, optimizer="adamw"))
    gpu = get_gpu("l4")
    est = estimate_per_op(graph, gpu, model=small_model)
    per_node = predict_nodes(graph.nodes, gpu, model=small_model)
    assert est.method == "per-op"
    assert est.step_ms == pytest.approx(per_node["ms"].sum())
    assert est.p10_ms <= est.step_ms <= est.p90_ms
    methods = set(per_node["method"])
    # gemm heads; attention falls back on the GEMM ratio; the optimizer on the elementwise head
    assert {
        "per-op",
        "roofline-calibrated (proxy: gemm)",
        "elementwise-head (bandwidth curve)",
    } <= methods
    host = (graph.nodes["family"] == "host").to_numpy()
    assert (per_node.loc[host, "ms"] == 0).all()


@pytest.mark.skipif(not PACKAGED.exists(), reason="no packaged per-op model")
def test_packaged_predictions_say_whether_the_gpu_was_measured():
    table = pd.DataFrame({"op": ["mm"], "M": [1024], "N": [1024], "K": [1024]})
    assert list(predict_ops(table, "a100-80gb-pcie")["basis"]) == ["measured"]
    assert list(predict_ops(table, "a100-80gb-sxm")["basis"]) == ["architecture measured"]
    assert list(predict_ops(table, "h100-sxm")["basis"]) == ["architecture not measured"]


@pytest.mark.skipif(not PACKAGED.exists(), reason="no packaged per-op model")
def test_zero_size_rows_launch_nothing_and_warn_nothing():
    table = pd.DataFrame({
        "op": ["mm", "mm", "bmm", "mm", "mm", "conv2d"],
        "B": [1, 1, 0, 2, 1, None], "M": [0, 64, 64, 64, 64, None],
        "N": [64, 64, 64, 0, 64, None], "K": [64, 0, 64, 32, 64, None],
        "batch": [None] * 5 + [0], "in_channels": [None] * 5 + [3],
        "out_channels": [None] * 5 + [8], "kernel_size": [None] * 5 + [3],
        "input_h": [None] * 5 + [32],
    })  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's divide-by-zero would fail the test
        out = predict_ops(table, "l4")
        fill = predict_ops(pd.DataFrame({"op": ["fill"], "numel": [2 * 64 * 32]}), "l4")
    assert list(out["method"]) == [
        "empty",
        "empty",
        "empty",
        f"{fill['method'].iloc[0]} (fill: N is 0)",
        "gemm-tiles",
        "empty",
    ]
    assert list(out["pred_ms"].iloc[[0, 1, 2, 5]]) == [0.0] * 4
    # N = 0 sums over nothing: PyTorch zero-fills the B*M*K output
    assert out.loc[3, ["pred_ms", "p10_ms", "p90_ms"]].tolist() == (
        fill.loc[0, ["pred_ms", "p10_ms", "p90_ms"]].tolist()
    )
    assert out.loc[4, "pred_ms"] > 0


def test_cli_echoes_the_input_columns_as_written(tmp_path):
    """Integer columns with empty cells stay integer, and a column holding 1e9 (read as
    floats) gives its other cells back as written: its 1000 had come back as 1000.0."""
    src = tmp_path / "ops.csv"
    src.write_text("op,B,M,N,K,latency_ms\nmm,1,64,64,64,0.5\nmm,,64,64,64,\nbmm,2,64,64,1e3,1\n")
    lines = run({"input": str(src), "gpu": "l4"}).splitlines()
    assert [line.split(",")[:6] for line in lines] == [
        ["op", "B", "M", "N", "K", "latency_ms"],
        ["mm", "1", "64", "64", "64", "0.5"],
        ["mm", "", "64", "64", "64", ""],
        ["bmm", "2", "64", "64", "1e3", "1"],
    ]


def test_bf16_matrix_rows_before_ampere_are_noted(tmp_path, capsys):
    src = tmp_path / "ops.csv"
    src.write_text(
        "op,B,M,N,K,rows,cols,dtype\nmm,1,64,64,64,,,bf16\nbmm,2,64,64,64,,,bf16\n"
        "mm,1,64,64,64,,,fp16\nsoftmax,,,,,8,64,bf16\n"
        "mm,1,0,64,64,,,bf16\n"  # no output elements: runs nothing, timed at no rate
    )
    run({"input": str(src), "gpu": "t4"})
    assert capsys.readouterr().err.strip() == (
        "note: t4 has no bf16 tensor cores (before Ampere): 2 bf16 matrix row(s) are timed at "
        "its fp32 rate; fp16 runs on its tensor cores"
    )
    run({"input": str(src), "gpu": "a100-80gb-pcie"})
    assert capsys.readouterr().err == ""
    run({"input": str(src), "gpu": "gtx-1080-ti"})  # Pascal: no tensor cores at all
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("it has no tensor cores (Pascal): fp16 runs at its fp16 rate on CUDA cores")
    )


def test_conv1d_is_a_conv2d_one_pixel_wide_and_grad_wrt_is_checked():
    one_d = predict_ops(pd.DataFrame({"op": ["conv1d"], "batch": [8], "in_channels": [64],
                                      "out_channels": [64], "kernel_size": [3],
                                      "input_h": [512]}), "l4")  # fmt: skip
    two_d = predict_ops(pd.DataFrame({"op": ["conv2d"], "batch": [8], "in_channels": [64],
                                      "out_channels": [64], "kernel_size": [3], "input_h": [512],
                                      "input_w": [1], "kernel_w": [1]}), "l4")  # fmt: skip
    assert one_d["pred_ms"].iloc[0] == two_d["pred_ms"].iloc[0]
    conv = {"op": ["conv2d"] * 2, "batch": [8] * 2, "in_channels": [64] * 2,
            "out_channels": [64] * 2, "kernel_size": [3] * 2, "input_h": [56] * 2,
            "direction": ["backward"] * 2}  # fmt: skip
    spelled = predict_ops(pd.DataFrame({**conv, "grad_wrt": [" Weight", "weight"]}), "l4")
    assert spelled["pred_ms"].iloc[0] == spelled["pred_ms"].iloc[1]
    for grad, direction, words in [("bogus", "backward", "grad_wrt must be input or weight"),
                                   ("weight", "forward", "backward conv rows only"),
                                   (None, "backward", "needs grad_wrt=input or weight")]:  # fmt: skip
        with pytest.raises(InvalidInputError, match=words):
            predict_ops(pd.DataFrame({**conv, "direction": [direction] * 2,
                                      "grad_wrt": [grad] * 2}), "l4")  # fmt: skip
    with pytest.raises(InvalidInputError, match="conv1d has no width; leave input_w out"):
        predict_ops(pd.DataFrame({"op": ["conv1d"], "batch": [8], "in_channels": [64],
                                  "out_channels": [64], "kernel_size": [3], "input_h": [512],
                                  "input_w": [7]}), "l4")  # fmt: skip


def test_cli_keys_and_gpu_lists_are_one_line(tmp_path: Path) -> None:
    """A misspelled key is refused as predict's are (not Hydra's three lines), and a list of
    GPUs is named as such (it was read as the GPU "['l4', 't4']")."""
    from boom_ml.predict import check_override_keys
    from boom_ml.predict_ops import run

    with pytest.raises(InvalidInputError, match=r"unknown option 'gpus' \(did you mean: gpu\?\)"):
        check_override_keys(["input=x.csv", "gpus=l4"], "predict_ops")
    csv = tmp_path / "ops.csv"
    csv.write_text("op,B,M,N,K\nlinear,1,64,64,64\n")
    with pytest.raises(InvalidInputError, match="one GPU per call"):
        run({"input": str(csv), "gpu": ["l4", "t4"]})
    with pytest.raises(InvalidInputError, match="not a file"):  # was pandas' IsADirectoryError
        run({"input": str(tmp_path), "gpu": "l4"})


def test_cli_comma_gpus_are_one_line(tmp_path: Path) -> None:
    """gpu=l4,t4 (predict's way to name two GPUs) is the one-GPU line, not Hydra's
    five-line "Ambiguous value". A subprocess: Hydra's logging setup, run in this process,
    would disable the loggers later tests read."""
    csv = tmp_path / "ops.csv"
    csv.write_text("op,B,M,N,K\nlinear,1,64,64,64\n")
    done = subprocess.run(
        [sys.executable, "-m", "boom_ml.predict_ops", f"input={csv}", "gpu=l4,t4"],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        "error: predict_ops times the ops on one GPU per call: gpu=<id>, got ['l4', 't4']\n"
    )


def test_a_fill_is_timed_as_the_step_times_it() -> None:
    """A fill writes N elements and reads none: predict_ops gives the step path's time of a
    traced ``fill_`` over N (timing/bandwidth.py), not a copy's (which reads N too)."""
    import json

    from boom_ml.gpus import get_gpu
    from boom_ml.timing.bandwidth import METHOD
    from boom_ml.timing.per_op import predict_nodes
    from boom_ml.trace.graph import NODE_COLUMNS

    n = 16_777_216
    node = {"id": 0, "aten_op": "aten.fill_.Scalar", "op": "fill_", "family": "fill",
            "phase": "backward", "module": "", "input_shapes": json.dumps([[n]]),
            "input_dtypes": json.dumps(["float32"]), "output_shapes": json.dumps([[n]]),
            "output_dtypes": json.dumps(["float32"]), "flops": 0,
            "bytes_read": 4 * n, "bytes_written": 4 * n}  # fmt: skip
    nodes = pd.DataFrame([node], columns=list(NODE_COLUMNS)).astype(NODE_COLUMNS)
    in_step = predict_nodes(nodes, get_gpu("l4"))
    out = predict_ops(pd.DataFrame({"op": ["fill", "copy"], "numel": [n, n]}), "l4")
    assert out["pred_ms"].iloc[0] == pytest.approx(float(in_step["ms"][0]), abs=1e-6)
    assert out["method"].iloc[0] == METHOD == in_step["method"][0]
    # on a B200 the size floor raises this fill, and both say so
    b200_step = predict_nodes(nodes, get_gpu("b200"))
    b200 = predict_ops(pd.DataFrame({"op": ["fill"], "numel": [n]}), "b200")
    assert b200["pred_ms"].iloc[0] == pytest.approx(float(b200_step["ms"][0]), abs=1e-6)
    assert b200["method"].iloc[0] == f"{METHOD} (one-element floor)" == b200_step["method"][0]
    assert out["pred_ms"].iloc[0] < out["pred_ms"].iloc[1]  # half the bytes of the copy


def test_inconsistent_or_impossible_sizes_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="row 1 gives numel 50 but rows x cols 100"):
        canonical_rows(
            pd.DataFrame({"op": ["rms_norm"], "rows": [10], "cols": [10], "numel": [50]})
        )
    with pytest.raises(InvalidInputError, match="column m holds 1e\\+30: no tensor dimension"):
        canonical_rows(pd.DataFrame({"op": ["mm"], "B": [1], "M": [1e30], "N": [8], "K": [8]}))


def test_a_causal_sdpa_row_is_timed_as_the_step_times_it() -> None:
    """``causal=1``: the kept pairs' work, as a traced causal SDPA call (the step's flash node
    of Qwen2.5-0.5B, 4 x 512 bf16, was 15 % faster than the same row without the flag)."""
    shape = {"op": "sdpa", "batch": 4, "heads": 14, "seq_q": 512, "head_dim": 64, "dtype": "bf16"}
    table = pd.DataFrame([{**shape, "causal": 0}, {**shape, "causal": 1}, shape])
    ms = predict_ops(table, "a100-40gb-sxm")["pred_ms"].tolist()
    assert ms[1] < ms[0] == ms[2]  # no flag: the full square
    for bad, words in (({**shape, "causal": 2}, "causal must be 0 or 1"),
                       ({"op": "add", "numel": 8, "causal": 1}, "attention \\(sdpa\\) rows only")):  # fmt: skip
        with pytest.raises(InvalidInputError, match=words):
            canonical_rows(pd.DataFrame([bad]))


@pytest.mark.skipif(not PACKAGED.exists(), reason="no packaged per-op model")
def test_backward_rows_of_forward_only_families_are_said_and_empty_ones_empty(tmp_path):
    """A hunt: gelu / softmax / layer_norm backward rows came back as the forward kernel's time
    without a word, and a softmax backward over 0 rows took 0.033 ms; an embedding's backward
    over 0 lookups still fills its weight gradient."""
    from boom_ml.predict_ops import notes

    table = pd.DataFrame({
        "op": ["gelu", "gelu", "softmax", "gelu", "layer_norm", "embedding"],
        "rows": [64, 64, 0, 0, 64, 0], "cols": [256, 256, 16, 16, 256, 64],
        "direction": ["forward", "backward", "backward", "backward", "backward", "backward"],
    })  # fmt: skip
    out = predict_ops(table, "a100-80gb-sxm")
    assert list(out["method"].iloc[2:4]) == ["empty", "empty"]
    assert out["method"].iloc[5] != "empty" and out["pred_ms"].iloc[5] > 0
    assert out["pred_ms"].iloc[0] == out["pred_ms"].iloc[1]  # the forward kernel's time
    (note,) = notes(table, "a100-80gb-sxm")
    assert note.startswith(
        "note: 2 backward row(s) of gelu, layer_norm: no backward kernel of these ops was measured"
    )
    path = tmp_path / "ops.csv"
    table.to_csv(path, index=False)
    done = subprocess.run([sys.executable, "-m", "boom_ml.predict_ops", f"input={path}",
                           "gpu=a100-80gb-sxm"], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and "note: 2 backward row(s)" in done.stderr


def test_missing_keys_and_bad_directions_are_named():
    from boom_ml.errors import InvalidInputError
    from boom_ml.predict_ops import run

    with pytest.raises(InvalidInputError, match="^gpu not given; usage: python -m boom_ml"):
        run({"input": "ops.csv"})
    table = pd.DataFrame({"op": ["gelu", "gelu"], "numel": [4, 4],
                          "direction": ["forward", "forwards"]})  # fmt: skip
    with pytest.raises(
        InvalidInputError, match=r"direction must be forward or backward \(row 2: 'forwards'\)"
    ):
        predict_ops(table, "l4")


def test_grouped_and_unmeasured_half_precision_rows_are_noted() -> None:
    """As predict's table says: a depthwise row extrapolates the conv head (no table has one),
    and fp16 convolutions on an Ada or Hopper GPU no fp16 convolution of theirs was measured
    on; a T4's (Turing, DeepBench) fp16 convolution needs no such note."""
    from boom_ml.predict_ops import notes

    table = pd.DataFrame({"op": ["conv2d", "conv2d"], "batch": [32, 32], "in_channels": [96, 96],
                          "out_channels": [96, 96], "kernel_size": [3, 3], "input_h": [112, 112],
                          "groups": [96, 1], "dtype": ["fp16", "fp32"]})  # fmt: skip
    grouped = "note: 1 grouped or depthwise convolution row(s): no kernel table measured one"
    t4 = notes(table, "t4")
    assert len(t4) == 1 and t4[0].startswith(grouped)
    ada = notes(table, "rtx-4090")
    assert ada[0].startswith(grouped)
    assert ada[1].startswith(
        "note: no GPU of rtx-4090's architecture had fp16/bf16 convolutions measured"
    )
    assert notes(table.assign(groups=1, dtype="fp32"), "rtx-4090") == []
