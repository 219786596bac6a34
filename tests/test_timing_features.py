"""Per-op features: the same op gets the same features at training and inference time.

Training sees canonical kernel rows (as the importers write them); inference sees traced
OpGraph nodes mapped by ``boom_ml.timing.per_op``. Every node table here is synthetic (made
up shapes for the mapping), never a measurement.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from boom_ml.gpus import get_gpu
from boom_ml.timing.features import feature_columns, kernel_features, target
from boom_ml.timing.per_op import node_rows


def synthetic_node(op: str, family: str, ins: list, outs: list, phase: str = "forward",
                   dtype: str = "float32") -> dict:  # fmt: skip
    """One synthetic OpGraph node row (shapes only; flops/bytes are not used by heads)."""
    return {
        "id": 0, "aten_op": f"aten.{op}.default", "op": op, "family": family, "phase": phase,
        "module": "", "input_shapes": json.dumps(ins), "input_dtypes": json.dumps([dtype] * len(ins)),
        "output_shapes": json.dumps(outs), "output_dtypes": json.dumps([dtype] * len(outs)),
        "flops": 0, "bytes_read": 0, "bytes_written": 0,
    }  # fmt: skip


# (synthetic node, the canonical kernel row a measurement of the same op would be)
PAIRS = [
    (synthetic_node("mm", "gemm", [[512, 1024], [1024, 256]], [[512, 256]]),
     {"op": "mm", "family": "gemm", "b": 1, "m": 512, "n": 1024, "k": 256}),
    (synthetic_node("addmm", "gemm", [[256], [8 * 512, 1024], [1024, 256]], [[4096, 256]]),
     {"op": "linear", "family": "gemm", "b": 8, "m": 512, "n": 1024, "k": 256}),
    (synthetic_node("bmm", "gemm", [[16, 128, 64], [16, 64, 128]], [[16, 128, 128]]),
     {"op": "bmm", "family": "gemm", "b": 16, "m": 128, "n": 64, "k": 128}),
    (synthetic_node("cudnn_convolution", "conv", [[8, 64, 56, 56], [128, 64, 3, 3]], [[8, 128, 28, 28]]),
     {"op": "conv2d", "family": "conv", "batch": 8, "in_channels": 64, "out_channels": 128,
      "kernel_size": 3, "input_h": 56, "stride": 2, "padding": 1}),
    (synthetic_node("native_layer_norm", "norm", [[4, 128, 768], [768], [768]],
                    [[4, 128, 768], [4, 128, 1], [4, 128, 1]]),
     {"op": "layer_norm", "family": "norm", "numel": 4 * 128 * 768, "rows": 512, "cols": 768}),
    (synthetic_node("_softmax", "softmax", [[64, 1000]], [[64, 1000]]),
     {"op": "softmax", "family": "softmax", "numel": 64000, "rows": 64, "cols": 1000}),
    (synthetic_node("add", "elementwise", [[256, 4096], [256, 4096]], [[256, 4096]]),
     {"op": "add", "family": "elementwise", "numel": 256 * 4096, "rows": 256, "cols": 4096}),
    (synthetic_node("gelu", "elementwise", [[256, 4096]], [[256, 4096]]),
     {"op": "gelu", "family": "elementwise", "numel": 256 * 4096, "rows": 256, "cols": 4096}),
    (synthetic_node("mul", "elementwise", [[256, 4096]], [[256, 4096]]),
     {"op": "mul_scalar", "family": "elementwise", "numel": 256 * 4096, "rows": 256, "cols": 4096}),
    (synthetic_node("embedding", "embedding", [[50257, 768], [4, 128]], [[4, 128, 768]], dtype="float16"),
     {"op": "embedding", "family": "embedding", "numel": 512 * 768, "rows": 512, "cols": 768,
      "dtype": "float16"}),
]  # fmt: skip


@pytest.mark.parametrize("gpu_id", ["l4", "a100-80gb-pcie", "v100-pcie-32gb"])
@pytest.mark.parametrize("pair", PAIRS, ids=[p[0]["op"] for p in PAIRS])
def test_node_and_kernel_row_get_identical_features(pair, gpu_id):
    node, kernel = pair
    gpu = get_gpu(gpu_id)
    # TF32 off: NeuSight measured fp32 with cuDNN TF32 off (its SOURCE.md).
    mapped = node_rows(pd.DataFrame([node]), tf32=False)
    assert len(mapped) == 1
    train_row = pd.DataFrame(
        [{"dtype": "float32", "direction": "forward", "gpu_id": gpu_id, **kernel}]
    )
    at_train = kernel_features(train_row, {gpu_id: gpu})
    at_infer = kernel_features(mapped.drop(columns=["node_pos"]), gpu)
    head = at_train["head"].iloc[0]
    assert at_infer["head"].iloc[0] == head
    cols = [*feature_columns(head), "roof_ms", "flops", "bytes"]
    np.testing.assert_allclose(at_infer[cols].to_numpy(float), at_train[cols].to_numpy(float),
                               rtol=1e-12, equal_nan=True)  # fmt: skip


def test_mixed_frame_gives_each_row_its_own_features():
    gpu = get_gpu("t4")
    rows = node_rows(pd.DataFrame([p[0] for p in PAIRS])).drop(columns=["node_pos"])
    together = kernel_features(rows, gpu)
    for i in range(len(rows)):
        alone = kernel_features(rows.iloc[[i]], gpu)
        cols = [*feature_columns(alone["head"].iloc[0]), "roof_ms"]
        np.testing.assert_allclose(together.iloc[[i]][cols].to_numpy(float),
                                   alone[cols].to_numpy(float), equal_nan=True)  # fmt: skip


def test_gemm_roofline_and_waves():
    gpu = get_gpu("a100-80gb-pcie")
    row = pd.DataFrame([{"op": "bmm", "family": "gemm", "dtype": "float32", "direction": "forward",
                         "b": 4, "m": 1024, "n": 1024, "k": 1024}])  # fmt: skip
    f = kernel_features(row, gpu).iloc[0]
    flops = 2 * 4 * 1024**3
    assert f["flops"] == flops
    assert f["roof_ms"] == pytest.approx(flops / (gpu.fp32_tflops * 1e12) * 1e3 + 0.005)
    tiles = 4 * 8 * 8  # 128x128 output tiles
    assert f["wave_eff_128x128"] == pytest.approx(
        tiles / (np.ceil(tiles / gpu.sm_count) * gpu.sm_count)
    )
    fp16 = kernel_features(row.assign(dtype="float16"), gpu).iloc[0]
    assert fp16["tensor_core"] == 1.0 and fp16["roof_ms"] < f["roof_ms"]
    assert np.isfinite(target(np.array([2.0]), np.array([1.0]))).all()


def test_conv_backward_becomes_input_and_weight_rows():
    ins = [[8, 128, 28, 28], [8, 64, 56, 56], [128, 64, 3, 3]]
    node = synthetic_node("convolution_backward", "conv", ins, [[8, 64, 56, 56], [128, 64, 3, 3]],
                          phase="backward")  # fmt: skip
    rows = node_rows(pd.DataFrame([node]))
    assert sorted(rows["grad_wrt"]) == ["input", "weight"]
    assert (rows[["stride", "padding", "input_h"]].to_numpy() == [2, 1, 56]).all()
    first_layer = synthetic_node(
        "convolution_backward", "conv", ins, [[128, 64, 3, 3]], phase="backward"
    )
    assert list(node_rows(pd.DataFrame([first_layer]))["grad_wrt"]) == ["weight"]


def test_host_nodes_have_no_rows_and_unknown_ops_use_traced_counts():
    host = synthetic_node("item", "host", [[1]], [[1]])
    foreach = synthetic_node("_foreach_add_", "optimizer", [[10, 10], [10]], [])
    foreach.update(flops=110, bytes_read=880, bytes_written=440)
    rows = node_rows(pd.DataFrame([host, foreach]))
    assert list(rows["node_pos"]) == [1]
    f = kernel_features(rows.drop(columns=["node_pos"]), get_gpu("l4"))
    assert f["bytes"].iloc[0] == 1320 and f["head"].iloc[0] == "optimizer"


def test_spec_without_l2_or_clock_still_featurises():
    from dataclasses import replace

    gpu = replace(get_gpu("l4"), l2_cache_mb=None, boost_clock_mhz=None, tdp_w=None)
    row = pd.DataFrame([PAIRS[0][1] | {"dtype": "float32", "direction": "forward"}])
    f = kernel_features(row, gpu)
    # the blanks take the Ada GPUs' medians (spec_medians), never a NaN
    assert f[["g_l2_mb", "g_clock", "g_tdp"]].notna().all().all()
    assert np.isfinite(f["roof_ms"].iloc[0])


def test_a_blank_spec_field_takes_its_architectures_median():
    """The GH200's sheet gives no TDP (its power covers the CPU) and no clock: the features
    take the Hopper GPUs' medians, not a NaN no trained model has seen."""
    import statistics

    from boom_ml.gpus import all_gpus
    from boom_ml.timing.spec_sheet import gpu_table

    hopper = [g for g in all_gpus() if g.architecture == "hopper"]
    g = gpu_table({"gh200": get_gpu("gh200")}).loc["gh200"]
    assert g["g_tdp"] == statistics.median(x.tdp_w for x in hopper if x.tdp_w)
    assert g["g_clock"] == statistics.median(x.boost_clock_mhz for x in hopper if x.boost_clock_mhz)
    assert not gpu_table({g.id: g for g in all_gpus()}).isna().any().any()


def test_a_causal_attention_row_is_timed_on_its_kept_pairs() -> None:
    """The trace counts a causal mask's kept pairs (trace/ops.py: _causal); the attention
    features take that count, so a causal SDPA call is not timed as the full square (a flash
    kernel skips the masked blocks). Without a count, the full square, or the kept pairs where the
    row says ``causal`` (predict_ops' CSV rows)."""
    from boom_ml.trace.sdpa_select import causal_pairs

    b, h, s, d = 8, 12, 4096, 64
    full = 4 * b * h * s * s * d
    kept = full * causal_pairs(s, s) // (s * s)  # what the trace records with is_causal
    rows = pd.DataFrame({"op": ["sdpa"] * 3, "family": ["attention"] * 3, "dtype": ["float16"] * 3,
                         "direction": ["forward", "forward", "backward"], "batch": [b] * 3,
                         "heads": [h] * 3, "seq_q": [s] * 3, "seq_kv": [s] * 3, "head_dim": [d] * 3,
                         "flops": [np.nan, kept, 2.5 * kept]})  # fmt: skip
    feats = kernel_features(rows, get_gpu("a100-80gb-sxm"))
    assert feats["flops"].tolist() == [full, kept, 2.5 * kept]
    assert feats["roof_ms"].iloc[1] < 0.6 * feats["roof_ms"].iloc[0]  # compute-bound here
    # a row with no count but causal=1: the same kept share (square and longer queries)
    for sq, skv in ((s, s), (300, 128), (128, 300)):
        flag = pd.DataFrame({"op": ["sdpa"] * 2, "family": ["attention"] * 2,
                             "dtype": ["float16"] * 2, "direction": ["forward", "backward"],
                             "batch": [b] * 2, "heads": [h] * 2, "seq_q": [sq] * 2,
                             "seq_kv": [skv] * 2, "head_dim": [d] * 2, "causal": [1, 1]})  # fmt: skip
        square = 4 * b * h * sq * skv * d
        want = [square * causal_pairs(sq, skv) / (sq * skv)] * 2
        got = kernel_features(flag, get_gpu("a100-80gb-sxm"))["flops"].to_numpy() / [1, 2.5]
        np.testing.assert_allclose(got, want, rtol=1e-12)


# The statistics (mean, rstd) a norm keeps say how its elements fall into rows: outputs of a
# forward node, inputs of a backward one, where they come before the weight.
NORMS = [
    ("native_layer_norm_backward", [[4, 128, 768], [4, 128, 768], [4, 128, 1], [4, 128, 1],
                                    [768], [768]], [[4, 128, 768], [768], [768]],
     "layer_norm", 512, 768),
    ("_fused_rms_norm_backward", [[4, 128, 768], [4, 128, 768], [4, 128, 1], [768]],
     [[4, 128, 768], [768]], "rms_norm", 512, 768),
    # LayerNorm((64, 32), elementwise_affine=False): no weight, two normalised dims
    ("native_layer_norm", [[4, 64, 32]], [[4, 64, 32], [4, 1, 1], [4, 1, 1]],
     "layer_norm", 4, 2048),
    ("native_layer_norm_backward", [[4, 64, 32], [4, 64, 32], [4, 1, 1], [4, 1, 1]],
     [[4, 64, 32]], "layer_norm", 4, 2048),
    # GroupNorm(32, 64): N * G rows of C / G * H * W, whatever the (C,) weight
    ("native_group_norm", [[8, 64, 28, 28], [64], [64]], [[8, 64, 28, 28], [8, 32], [8, 32]],
     "group_norm", 8 * 32, 2 * 28 * 28),
    ("native_group_norm_backward", [[8, 64, 28, 28], [8, 64, 28, 28], [8, 32], [8, 32], [64]],
     [[8, 64, 28, 28], [64], [64]], "group_norm", 8 * 32, 2 * 28 * 28),
]  # fmt: skip


@pytest.mark.parametrize(
    "op,ins,outs,name,rows,cols", NORMS, ids=[f"{n[0]}-{k}" for k, n in enumerate(NORMS)]
)
def test_a_norm_row_follows_its_statistics_not_its_weight(op, ins, outs, name, rows, cols):
    phase = "backward" if op.endswith("_backward") else "forward"
    node = synthetic_node(op, "norm", ins, outs, phase=phase)
    row = node_rows(pd.DataFrame([node])).iloc[0]
    assert (row["op"], row["direction"], row["rows"], row["cols"]) == (name, phase, rows, cols)
