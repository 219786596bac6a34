"""nn.LSTM / nn.GRU / nn.RNN are traced as the two cuDNN calls a CUDA run makes, with the
reserve kept until backward, and timed as the kernels cuDNN's standard algorithm runs."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from boom_ml.trace import rnn_kernels

SYNTHETIC_RNN_MODELS = """
import torch
import torch.nn as nn

class Seq(nn.Module):
    def __init__(self, kind, **kw):
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 32, **kw)

    def forward(self, x):
        return self.rnn(x)[0]

    def example_inputs(self, batch_size, device, seq_len=10):
        shape = (batch_size, seq_len, 16) if self.rnn.batch_first else (seq_len, batch_size, 16)
        return {"x": torch.randn(*shape, device=device)}

def lstm():
    return Seq("LSTM", num_layers=2, bidirectional=True, batch_first=True)

def gru():
    return Seq("GRU")

def projected():
    return Seq("LSTM", proj_size=8)
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("rnn") / "seq.py"
    path.write_text(SYNTHETIC_RNN_MODELS)
    return path


def _graph(path, factory: str, batch: int = 4, seq: int = 10):
    from boom_ml.session import Session
    from boom_ml.specs import StepSpec

    return Session(f"file:{path}:{factory}", cache=False).graph(
        StepSpec(batch_size=batch, seq_len=seq, optimizer="sgd")
    )


def test_an_lstm_is_one_cudnn_call_each_way_with_its_reserve(models) -> None:
    g = _graph(models, "lstm")  # 2 layers, bidirectional, batch_first; T=10, N=4, In=16, H=32
    ops = g.nodes["op"].tolist()
    assert ops.count("cudnn_lstm") == 1 and ops.count("cudnn_lstm_backward") == 1
    assert not any("mkldnn" in op for op in ops)
    fwd = g.nodes[g.nodes["op"] == "cudnn_lstm"].iloc[0]
    t, n, h = 10, 4, 32
    gemm = 2 * t * n * (16 * 4 * h + h * 4 * h) * 2  # layer 0, both directions
    gemm += 2 * t * n * (64 * 4 * h + h * 4 * h) * 2  # layer 1 reads both directions
    assert int(fwd["flops"]) == gemm
    assert json.loads(fwd["output_shapes"])[:3] == [[t, n, 2 * h], [4, n, h], [4, n, h]]
    # the reserve: per layer, direction, step and sample 4 gates + c_t + h_t of 32, fp32
    reserve = 2 * 2 * t * n * 6 * h * 4
    ev = g.mem_events
    allocs = ev[(ev["node_id"] == int(fwd["id"])) & (ev["action"] == "alloc")]
    assert reserve in allocs["bytes"].tolist()
    block = int(allocs[allocs["bytes"] == reserve]["block"].iloc[0])
    bwd = int(g.nodes[g.nodes["op"] == "cudnn_lstm_backward"]["id"].iloc[0])
    freed = ev[(ev["block"] == block) & (ev["action"] == "free")]
    # alive until backward has read it
    assert len(freed) == 1 and int(freed["seq"].iloc[0]) > ev[ev["node_id"] == bwd]["seq"].max()
    # batch_first: the input is transposed to time-major and copied, as _cudnn_rnn does
    before = g.nodes[g.nodes["id"] < int(fwd["id"])]
    assert "clone" in before["op"].tolist() or "_to_copy" in before["op"].tolist() or (
        "copy_" in before["op"].tolist())  # fmt: skip


def test_a_gru_is_not_unrolled_per_step(models) -> None:
    g = _graph(models, "gru", seq=200)
    ops = g.nodes["op"].tolist()
    assert ops.count("cudnn_gru") == 1 and ops.count("cudnn_gru_backward") == 1
    assert len(ops) < 40  # the CPU path ran ~10 ops per time step (2,000 here)
    bwd = g.nodes[g.nodes["op"] == "cudnn_gru_backward"].iloc[0]
    shape = rnn_kernels.RnnShape("gru", 200, 4, 16, 32, 0, 1, 1)
    assert int(bwd["flops"]) == rnn_kernels.flops(shape, backward=True)


def test_a_projected_lstm_returns_the_projection_width(models) -> None:
    g = _graph(models, "projected")
    fwd = g.nodes[g.nodes["op"] == "cudnn_lstm"].iloc[0]
    out, hy, cy = json.loads(fwd["output_shapes"])[:3]
    assert out == [10, 4, 8] and hy == [1, 4, 8] and cy == [1, 4, 32]
    shape = rnn_kernels.shape_of("lstm", [10, 4, 16], hy, cy, out)
    assert (shape.hidden, shape.proj) == (32, 8)
    assert int(fwd["flops"]) == 2 * 40 * (16 * 128 + 8 * 128 + 32 * 8)


def test_kernel_rows_of_one_lstm_layer() -> None:
    shape = rnn_kernels.RnnShape("lstm", steps=25, batch=16, input_size=256, hidden=512,
                                 proj=0, layers=1, directions=1)  # fmt: skip
    fwd = [(r["family"], r.get("m"), r.get("n"), r.get("k"), r["repeat"])
           for r in rnn_kernels.kernel_rows(shape, backward=False)]  # fmt: skip
    assert fwd == [("gemm", 400, 256, 2048, 1), ("gemm", 16, 512, 2048, 25),
                   ("elementwise", None, None, None, 25)]  # fmt: skip
    bwd = [(r.get("m"), r.get("n"), r.get("k"), r["repeat"])
           for r in rnn_kernels.kernel_rows(shape, backward=True) if r["family"] == "gemm"]  # fmt: skip
    assert bwd == [(16, 2048, 512, 25), (400, 2048, 256, 1), (2048, 400, 256, 1),
                   (2048, 400, 512, 1)]  # fmt: skip
    skip = rnn_kernels.RnnShape("lstm", 25, 16, 512, 512, 0, 1, 1, linear_input=False)
    assert rnn_kernels.flops(skip, backward=False) == 8 * 512 * 512 * 16 * 25  # DeepBench's


def test_a_step_times_each_cudnn_kernel_as_often_as_it_runs(models) -> None:
    from boom_ml.gpus import get_gpu
    from boom_ml.timing.per_op import node_rows, predict_nodes_many

    g = _graph(models, "gru", seq=50)
    rows = node_rows(g.nodes)
    mine = rows[rows["node_pos"] == int(np.flatnonzero(g.nodes["op"] == "cudnn_gru")[0])]
    assert sorted(mine["repeat"].tolist()) == [1, 50, 50]
    assert set(mine["source"]) == {"library"}  # kernel time, no eager launch gap
    ms = predict_nodes_many(g.nodes, [get_gpu("a100-80gb-pcie")])["ms"][0]
    fwd = ms[g.nodes["op"].to_numpy() == "cudnn_gru"][0]
    assert fwd > 50 * 0.002  # 50 recurrent GEMMs and gate kernels, a few µs each at least


def test_deepbench_rnn_kernels_fp32_within_the_readme_figures() -> None:
    """Real data: DeepBench's cuDNN RNN rows (never fitted on), packaged models."""
    from training.validate_rnn import DATA, _ape, load_rows, predict

    if not DATA.exists():
        pytest.fail(f"shared DeepBench data missing at {DATA}")
    rows = load_rows()
    rows = rows[rows["precision"] == "fp32"]
    assert len(rows) == 212
    scored = predict(rows)
    assert _ape(scored.fwd_pred, scored.fwd_ms).mean() < 30.0
    assert _ape(scored.bwd_pred, scored.bwd_ms).mean() < 30.0
    assert isinstance(scored, pd.DataFrame)


def test_persistent_kernels_are_named_where_pytorch_picks_them(models) -> None:
    from dataclasses import replace

    from boom_ml.gpus import get_gpu
    from boom_ml.timing.library_calls import PERSISTENT_NOTE, RNN_METHOD
    from boom_ml.timing.per_op import predict_nodes_many

    lstm = rnn_kernels.RnnShape("lstm", 10, 4, 16, 192, 0, 1, 1)
    # RNN.cpp use_rnn_persist_small_h: hidden <= 192 forward, <= 128 backward (LSTM, GRU),
    # <= 384 / 256 for plain RNNs, from compute capability 6; never with a projection
    assert rnn_kernels.persistent(lstm, False, 8) and not rnn_kernels.persistent(lstm, True, 8)
    assert not rnn_kernels.persistent(replace(lstm, hidden=193), False, 8)
    assert rnn_kernels.persistent(replace(lstm, hidden=128), True, 6)
    assert not rnn_kernels.persistent(lstm, False, 5)
    tanh = replace(lstm, mode="rnn_tanh", hidden=384)
    assert rnn_kernels.persistent(tanh, False, 8) and not rnn_kernels.persistent(tanh, True, 8)
    assert not rnn_kernels.persistent(replace(lstm, hidden=64, proj=32), False, 8)
    a100 = get_gpu("a100-80gb-pcie")
    for factory, note in (("gru", True), ("projected", False)):  # hidden 32 both
        g = _graph(models, factory)
        methods = predict_nodes_many(g.nodes, [a100])["method"][0]
        rnn = g.nodes["op"].str.startswith("cudnn_").to_numpy()
        assert rnn.sum() == 2  # forward and backward
        expected = f"{RNN_METHOD}; {PERSISTENT_NOTE}" if note else RNN_METHOD
        assert set(methods[rnn]) == {expected}
