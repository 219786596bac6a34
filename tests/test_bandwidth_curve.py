"""Optimizer, copy, cast and fill kernels: the streams they are, timed by the elementwise head.

Nodes here are synthetic (made-up shapes) or traced from tests/tiny_models.py; the stub
boosters return a fixed log ratio so that each expected time is exact. Nothing is a
measurement.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from boom_ml.gpus import get_gpu
from boom_ml.specs import StepSpec
from boom_ml.timing.bandwidth import METHOD, describe, list_length
from boom_ml.timing.features import feature_columns, kernel_features
from boom_ml.timing.heads import PACKAGED_DIR, Head, PerOpModel
from boom_ml.timing.per_op import node_rows, predict_nodes
from boom_ml.timing.roofline import LAUNCH_MS

# One parameter list: 64*32 + 32 + 16*64 + 16 = 3120 elements in 4 tensors.
PARAMS = [[64, 32], [32], [16, 64], [16]]
N, T = 3120, 4
FP32 = 4


def node(op: str, family: str, ins: list, in_dt: list, outs: list, out_dt: list,
         read: int, written: int, phase: str = "optimizer") -> dict:  # fmt: skip
    """A synthetic OpGraph node with the recorder's byte counts (every input view read;
    fresh outputs and the inputs the schema marks mutable written)."""
    return {"id": 0, "aten_op": f"aten.{op}", "op": op, "family": family, "phase": phase,
            "module": "", "input_shapes": json.dumps(ins), "input_dtypes": json.dumps(in_dt),
            "output_shapes": json.dumps(outs), "output_dtypes": json.dumps(out_dt), "flops": 0,
            "bytes_read": read, "bytes_written": written}  # fmt: skip


def fused_adamw(grad_scale: bool = False) -> dict:
    # _fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, state_steps[, grad_scale, found_inf])
    extra = [[], []] if grad_scale else []
    ins = PARAMS * 4 + [[]] * T + extra
    read = 4 * FP32 * N + FP32 * T + FP32 * len(extra)  # 4 lists, the step counts, scalars
    return node("_fused_adamw_", "optimizer", ins, ["float32"] * len(ins), [], [],
                read=read, written=4 * FP32 * N)  # fmt: skip


def test_fused_adamw_reads_four_lists_and_writes_three():
    # fused_adam_utils.cuh: loads param, grad, exp_avg, exp_avg_sq (16N bytes) and one step
    # count per tensor (4T); stores param, exp_avg, exp_avg_sq (12N), the grad only with a
    # GradScaler's grad_scale. The recorder counts the grads written (schema: Tensor(b!)[]).
    s = describe("_fused_adamw_", "optimizer", PARAMS * 4 + [[]] * T, [], ["float32"] * 20, [],
                 16 * N + 4 * T, 16 * N)  # fmt: skip
    assert (s.read_bytes, s.write_bytes, s.numel, s.dtype) == (16 * N + 4 * T, 12 * N, N, "float32")
    assert s.nbytes == 28 * N + 4 * T == 87376
    row = s.row()
    # 4 lists read, capped at the head's widest op (3 read, 1 written): 87376 / (4 * 4) elements
    assert (row["arity"], row["numel"], row["bytes"], row["transcendental"]) == (
        3,
        5461,
        87376,
        1.0,
    )


def test_fused_adamw_under_a_grad_scaler_writes_the_grads_too():
    rows = node_rows(pd.DataFrame([fused_adamw(grad_scale=True)]))
    assert rows["bytes_written"].iloc[0] == 16 * N
    assert rows["bytes"].iloc[0] == (16 * N + 4 * T + 8) + 16 * N


def test_foreach_addcdiv_streams_three_lists_into_one():
    # _foreach_addcdiv_(params, exp_avgs, denoms): reads 3 lists, writes params in place
    ins = PARAMS * 3
    assert list_length(ins) == T
    rows = node_rows(pd.DataFrame([node("_foreach_addcdiv_", "optimizer", ins, ["float32"] * 12,
                                        [], [], read=12 * N, written=4 * N)]))  # fmt: skip
    r = rows.iloc[0]
    assert (r["bytes"], r["stream_numel"], r["arity"], r["numel"]) == (16 * N, N, 3, N)
    assert r["transcendental"] == 1.0  # a division per element, as addcdiv in features.py


def test_cast_fp32_to_bf16_reads_4n_writes_2n_as_traced():
    from tiny_models import tiny_transformer

    from boom_ml.trace.step import trace_step

    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2, seq_len=16, amp="bf16"))
    nodes = graph.nodes.reset_index(drop=True)
    rows = node_rows(nodes).set_index("node_pos")
    casts = [
        i for i, n in nodes.iterrows()
        if n["op"] == "_to_copy" and json.loads(n["input_dtypes"]) == ["float32"]
        and json.loads(n["output_dtypes"]) == ["bfloat16"]
    ]  # fmt: skip
    assert casts
    for i in casts:
        numel = math.prod(json.loads(nodes.at[i, "input_shapes"])[0])
        r = rows.loc[i]
        assert (r["bytes_read"], r["bytes_written"]) == (4 * numel, 2 * numel)
        # the widest dtype streamed sets the element width: 6N bytes = 1 read + 1 written fp32
        assert (r["dtype"], r["arity"], r["numel"]) == ("float32", 1, round(6 * numel / 8))


def test_copy_into_and_fills_read_nothing_they_overwrite():
    copy = node("copy_", "copy", [[N], [N]], ["bfloat16", "float32"], [[N]], ["bfloat16"],
                read=2 * N + 4 * N, written=2 * N, phase="forward")  # fmt: skip
    fill = node("ones_like", "fill", [[N]], ["float32"], [[N]], ["float32"], read=4 * N,
                written=4 * N, phase="forward")  # fmt: skip
    rows = node_rows(pd.DataFrame([copy, fill]))
    assert list(rows["bytes_read"]) == [4 * N, 0]
    assert list(rows["bytes_written"]) == [2 * N, 4 * N]


def test_stream_rows_keep_their_own_arity_in_features():
    # "copy" and "fill" name ops of the elementwise table (arity 1); a stream row's own counts win
    rows = pd.DataFrame([{"op": op, "family": "copy", "dtype": "float32", "direction": "forward",
                          "numel": 1000, "arity": 2, "transcendental": 0.0, "bytes": 12000}
                         for op in ("copy", "fill", "_to_copy")])  # fmt: skip
    f = kernel_features(rows, get_gpu("l4"))
    assert list(f["arity"]) == [2, 2, 2] and list(f["bytes"]) == [12000] * 3


class ConstBooster:
    """A booster stub: the same log(latency / roofline) for every row."""

    def __init__(self, value: float) -> None:
        self.value = value

    def predict(self, x: np.ndarray, num_threads: int = 1) -> np.ndarray:
        return np.full(len(x), self.value)


FALLBACK = {h: {"proxy": p, "p10": 0.1, "p50": 0.2, "p90": 0.3}
            for h, p in (("optimizer", "elementwise"), ("copy", "elementwise"),
                         ("attention", "gemm"))}  # fmt: skip


def elementwise_model(log_ratio: float) -> PerOpModel:
    models = {"p50": ConstBooster(log_ratio), "p10": ConstBooster(log_ratio - 0.5),
              "p90": ConstBooster(log_ratio + 0.5)}  # fmt: skip
    head = Head("elementwise", feature_columns("elementwise"), models, families=["elementwise"],
                directions=["forward"])  # fmt: skip
    return PerOpModel({"elementwise": head}, FALLBACK)


def test_curve_is_the_elementwise_head_on_the_stream_and_never_below_bandwidth():
    gpu = get_gpu("a100-80gb-pcie")
    nodes = pd.DataFrame([fused_adamw()])
    nbytes = 28 * N + 4 * T
    bound = nbytes / gpu.bandwidth_bytes_per_s * 1e3
    compute = 5461 * 8 / (gpu.fp32_tflops * 1e12) * 1e3  # transcendental: 8 FLOPs per element
    roof = max(bound, compute) + LAUNCH_MS
    fast = predict_nodes(nodes, gpu, model=elementwise_model(0.3)).iloc[0]
    assert fast["method"] == METHOD
    assert fast["ms"] == pytest.approx(roof * math.exp(0.3), rel=1e-12)
    assert fast["p10"] == pytest.approx(roof * math.exp(-0.2), rel=1e-12)
    # a head that predicts a stream faster than DRAM allows is held at bytes / bandwidth
    slow = predict_nodes(nodes, gpu, model=elementwise_model(-10.0)).iloc[0]
    assert slow["method"] == METHOD
    for q in ("ms", "p10", "p90"):
        assert slow[q] >= bound
        assert slow[q] == pytest.approx(bound, rel=1e-12)


def test_without_an_elementwise_head_the_calibrated_roofline_says_its_proxy():
    gpu = get_gpu("l4")
    attn = node("_scaled_dot_product_flash_attention", "attention",
                [[2, 4, 16, 8]] * 3, ["float16"] * 3, [[2, 4, 16, 8]], ["float16"], 0, 0,
                phase="forward")  # fmt: skip
    nodes = pd.DataFrame([fused_adamw(), attn])
    bare = predict_nodes(nodes, gpu, model=PerOpModel({}, FALLBACK))
    assert list(bare["method"]) == ["roofline-calibrated (proxy: elementwise)",
                                    "roofline-calibrated (proxy: gemm)"]  # fmt: skip
    roof = kernel_features(node_rows(nodes).drop(columns=["node_pos"]), gpu)["roof_ms"]
    assert bare["ms"].iloc[0] == pytest.approx(roof.iloc[0] * math.exp(0.2), rel=1e-12)
    # with one, only the stream changes method: attention keeps its calibrated roofline
    curve = predict_nodes(nodes, gpu, model=elementwise_model(0.3))
    assert list(curve["method"]) == [METHOD, "roofline-calibrated (proxy: gemm)"]


@pytest.mark.skipif(not (PACKAGED_DIR / "model.json").exists(), reason="no packaged model")
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_packaged_heads_time_every_traced_stream_above_its_bandwidth_bound(impl):
    from tiny_models import tiny_transformer

    from boom_ml.timing.heads import load_model
    from boom_ml.trace.step import trace_step

    step = StepSpec(batch_size=2, seq_len=16, amp="bf16", optimizer="adamw", optimizer_impl=impl)
    graph = trace_step(tiny_transformer(), step)
    rows = node_rows(graph.nodes)
    streams = rows[rows["family"].isin(["optimizer", "copy", "fill"])]
    assert (streams["family"] == "optimizer").any() and (streams["family"] == "copy").any()
    model = load_model(str(PACKAGED_DIR))
    for gpu_id in ("l4", "a100-80gb-pcie", "h100-sxm"):  # H100: no Hopper row in training
        gpu = get_gpu(gpu_id)
        pred = predict_nodes(graph.nodes, gpu, model=model)
        pos = streams["node_pos"].to_numpy()
        bound = streams["bytes"].to_numpy() / gpu.bandwidth_bytes_per_s * 1e3
        # the curve's method, "(one-element floor)" after it where the size floor raised a row
        assert all(m.startswith(METHOD) for m in pred["method"].to_numpy()[pos])
        for q in ("ms", "p10", "p90"):
            assert (pred[q].to_numpy()[pos] >= bound).all()
