"""The traces behind the GNN's training rows (``training/step_traces.py``): each measured row
traced as its run ran (eager attention for NeuSight's labels, in-place zero_grad for the 2020
CNN script and timm's benchmark), and the graph cache that keeps them."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pandas as pd
import timm
import torch
import transformers

from boom_ml.timing import gnn_features
from tests.tiny_models import tiny_llama_config
from training.step_traces import GraphCache, TraceConfig, row_trace_config, trace_config


def test_neusight_rows_trace_eager_attention(tmp_path) -> None:
    """NeuSight measured HF models with eager attention (its SOURCE.md): their rows trace the
    bmm-softmax-bmm path, other sources the SDPA kernel a default build records."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_llama_config(vocab_size=1000)))
    row = {"model": f"hf:{path}", "batch_size": 2, "seq_len": 32, "image_size": None,
           "optimizer": "none", "amp": None, "checkpointing": None, "precision": "float32",
           "phase_scope": "fwd+bwd"}  # fmt: skip
    eager = row_trace_config(pd.Series({**row, "source": "neusight_labels"}))
    sdpa = row_trace_config(pd.Series({**row, "source": "timm_train"}))
    assert (eager.attention, sdpa.attention) == ("eager", "sdpa")
    assert eager.key() != sdpa.key()
    ops = {name: set(trace_config(cfg).nodes["op"]) for name, cfg in
           (("eager", eager), ("sdpa", sdpa))}  # fmt: skip
    attention = {op for op in ops["sdpa"] if "scaled_dot_product" in op}
    assert attention and not any("scaled_dot_product" in op for op in ops["eager"])
    assert "_softmax" in ops["eager"] and "bmm" in ops["eager"]


def test_cnn_2020_script_rows_zero_gradients_in_place() -> None:
    """cnn_step_times' 2020 script calls model.zero_grad() on PyTorch 1.7 (set_to_none=False
    by default): its rows trace zero_grad="zero"; the 2018 script's rows and other sources
    keep the default, whose cache key did not change when the fields were added."""
    row = {"model": "torchvision:squeezenet1_1", "batch_size": 12, "seq_len": None,
           "image_size": 64, "optimizer": "none", "amp": None, "checkpointing": None,
           "precision": "float32", "phase_scope": "fwd+bwd", "source": "cnn_step_times"}  # fmt: skip
    new = row_trace_config(pd.Series({**row, "run_id": "script2020"}))
    old = row_trace_config(pd.Series({**row, "run_id": "script2018-card1"}))
    assert (new.zero_grad, old.zero_grad) == ("zero", "set_to_none")
    assert new.key() != old.key()
    new_fields = ("zero_grad", "zero_grad_timed")
    fields = {k: v for k, v in dataclasses.asdict(old).items() if k not in new_fields}
    blob = json.dumps([fields, torch.__version__, timm.__version__, transformers.__version__],
                      sort_keys=True)  # fmt: skip
    assert old.key() == hashlib.sha1(blob.encode()).hexdigest()[:16]
    zeroed = trace_config(new).nodes
    assert (zeroed["op"][zeroed["phase"] == "zero_grad"] == "zero_").sum() == 52  # parameters


def test_timm_rows_add_into_gradients_zeroed_before_the_timer() -> None:
    """timm's benchmark calls optimizer.zero_grad() (PyTorch 1.12: in place) before its timer:
    the timed backward adds into each kept gradient (one add_ per parameter, 52 in
    squeezenet1_1) and the zeroing kernels are not in the step."""
    row = {"model": "torchvision:squeezenet1_1", "batch_size": 12, "seq_len": None,
           "image_size": 64, "optimizer": "sgd", "amp": "fp16", "checkpointing": None,
           "precision": "amp", "phase_scope": "fwd+bwd", "source": "timm_train"}  # fmt: skip
    timm_cfg = row_trace_config(pd.Series(row))
    assert (timm_cfg.zero_grad, timm_cfg.zero_grad_timed) == ("zero", False)
    timed = dataclasses.replace(timm_cfg, zero_grad_timed=True)
    assert timed.key() != timm_cfg.key()
    nodes = trace_config(timm_cfg).nodes
    whole = trace_config(timed).nodes
    assert not (nodes["phase"] == "zero_grad").any()
    assert (whole["phase"] == "zero_grad").sum() > 0
    backward_adds = nodes["op"][nodes["phase"] == "backward"].eq("add_").sum()
    assert backward_adds == 52
    assert len(whole) - len(nodes) == (whole["phase"] == "zero_grad").sum()
    inference = row_trace_config(pd.Series({**row, "phase_scope": "fwd"}))
    assert (inference.zero_grad, inference.zero_grad_timed) == ("set_to_none", True)


def test_graph_round_trips_through_cache(tmp_path) -> None:
    cfg = TraceConfig("torchvision:squeezenet1_1", 2, None, 64, "none", "none", "none",
                      half=True, forward_only=False)  # fmt: skip
    first = GraphCache(tmp_path)
    traced = first.get(cfg)
    assert not isinstance(traced, str) and first.traced == 1
    conv_dtypes = traced.nodes.loc[traced.nodes["family"] == "conv", "input_dtypes"]
    assert {d for s in conv_dtypes for d in json.loads(s)} == {"float16"}  # model.half()
    second = GraphCache(tmp_path)
    loaded = second.get(cfg)
    assert second.traced == 0  # read from disk, not traced again
    assert loaded.nodes.equals(traced.nodes) and loaded.edges.equals(traced.edges)
    assert loaded.meta["trace_config"]["model"] == cfg.model
    a, b = gnn_features.graph_data(traced), gnn_features.graph_data(loaded)
    assert torch.equal(a.x, b.x) and torch.equal(a.edge_index, b.edge_index)
