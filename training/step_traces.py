"""One measured step -> the configuration it ran -> its traced operator graph, cached on disk.

A row of the canonical steps table names what it measured (model, batch, image size or
sequence length, optimizer, AMP, pure fp16) and its source's SOURCE.md says how (attention
implementation, how gradients were cleared, PyTorch's TF32 defaults of its release):
``row_trace_config`` and ``row_tf32`` turn both into a ``TraceConfig``. Traces do not depend
on the GPU, so ``GraphCache`` keeps one per configuration, shared by every GPU that measured
it. ``training/graph_dataset.py`` joins them to the measurements.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from boom_ml.timing.tf32 import Tf32, from_torch_version
from boom_ml.trace.graph import OpGraph
from data_collection.paths import shared_data_dir

# PyTorch of sources whose rows leave torch_version empty (their SOURCE.md): the 2020
# cnn_step_times A100 run used the NGC 20.10 container; NeuSight used 2.1.0.
SOURCE_TORCH = {"cnn_step_times": "1.7", "neusight_labels": "2.1.0"}
# Attention implementation of sources measured with HF transformers: NeuSight built its models
# "with eager attention" (neusight/SOURCE.md), so their graphs are traced with eager
# attention (bmm, softmax, bmm), not with the SDPA kernel a default build would record.
SOURCE_ATTENTION = {"neusight_labels": "eager"}
# Rows whose measured step cleared gradients with zero_grad(set_to_none=False), PyTorch 1.x's
# default: cnn_step_times' 2020 script calls model.zero_grad() on PyTorch 1.7 (its SOURCE.md),
# so each step zeroes every gradient in place and backward adds into them. The 2018 script's
# step is not described beyond its input, so its rows keep the default.
ZERO_GRAD_RUNS = {"cnn_step_times": ("script2020",)}
# Sources whose loop cleared gradients in place before its timer started: timm's
# TrainBenchmarkRunner calls optimizer.zero_grad() (PyTorch 1.12: set_to_none=False) and then
# starts the timer (timm_bench/SOURCE.md), so its timed backward adds into the kept gradients
# while the zeroing kernels stay out of the step.
ZERO_GRAD_UNTIMED = ("timm_train",)
# timm's benchmark builds its "sgd" with create_optimizer_v2: SGD, nesterov momentum 0.9.
OPTIMIZER_ALIASES = {("timm_train", "sgd"): "sgd-momentum"}


@dataclass(frozen=True)
class TraceConfig:
    """Everything a trace depends on (the GPU is not among it)."""

    model: str
    batch_size: int
    seq_len: int | None
    image_size: int | None
    optimizer: str
    amp: str
    checkpointing: str
    half: bool  # whole model and batch in fp16 (``model.half()``), not AMP
    forward_only: bool  # inference rows: keep the forward nodes only
    attention: str = "sdpa"  # HF attn_implementation the measured run used (hf: models only)
    zero_grad: str = "set_to_none"  # StepSpec.zero_grad of the measured loop
    zero_grad_timed: bool = True  # False: the loop zeroed before its timer (nodes dropped)

    def key(self) -> str:
        import timm
        import transformers

        fields = asdict(self)
        for name, default in (("zero_grad", "set_to_none"), ("zero_grad_timed", True)):
            if fields[name] == default:  # keys from before the field stay valid
                del fields[name]
        blob = json.dumps([fields, torch.__version__, timm.__version__,
                           transformers.__version__], sort_keys=True)  # fmt: skip
        return hashlib.sha1(blob.encode()).hexdigest()[:16]


def resolve_model(spec: str) -> str:
    """``hf:neusight/...json`` names a file under the shared data dir: make it absolute."""
    if spec.startswith("hf:") and spec.endswith(".json"):
        path = shared_data_dir() / spec[3:]
        if path.exists():
            return f"hf:{path}"
    return spec


def trace_config(cfg: TraceConfig) -> OpGraph:
    """Build and trace one configuration (seconds; use GraphCache to do it once)."""
    from boom_ml.specs import ModelSpec, StepSpec
    from boom_ml.trace.step import trace_step
    from boom_ml.zoo import build_model

    hf = {"attn_implementation": cfg.attention} if cfg.model.startswith("hf:") else {}
    built = build_model(ModelSpec(resolve_model(cfg.model), dict(hf)))
    strict = getattr(getattr(built.module, "patch_embed", None), "strict_img_size", False)
    if cfg.image_size and strict and built.default_image_size != cfg.image_size:
        # timm's benchmark builds patch models at the size it runs them at.
        opts = {"img_size": cfg.image_size, **hf}
        built = build_model(ModelSpec(resolve_model(cfg.model), opts))
    if cfg.half:
        built.module.half()
        make = built.make_inputs

        def half_inputs(step: Any, device: torch.device) -> dict[str, Any]:
            batch = make(step, device)
            return {k: v.half() if torch.is_tensor(v) and v.is_floating_point() else v
                    for k, v in batch.items()}  # fmt: skip

        built.make_inputs = half_inputs
    step = StepSpec(cfg.batch_size, cfg.seq_len, cfg.image_size, cfg.optimizer, cfg.amp,
                    cfg.checkpointing, zero_grad=cfg.zero_grad)  # fmt: skip
    graph = trace_step(built, step)
    phase = graph.nodes["phase"].astype(str)
    if cfg.forward_only:  # an inference row: the forward nodes of the step
        graph = subgraph(graph, phase.eq("forward").to_numpy(), forward_only=True)
    elif not cfg.zero_grad_timed:
        graph = subgraph(graph, phase.ne("zero_grad").to_numpy(), zero_grad_timed=False)
    return graph


def subgraph(graph: OpGraph, keep: Any, **meta: Any) -> OpGraph:
    """The nodes under the mask ``keep``, with the edges and memory events among them."""
    nodes = graph.nodes[keep].reset_index(drop=True)
    ids = set(nodes["id"].tolist())
    edges = graph.edges[graph.edges["src"].isin(ids) & graph.edges["dst"].isin(ids)]
    events = graph.mem_events[graph.mem_events["node_id"].isin(ids)]
    return OpGraph(nodes, edges.reset_index(drop=True), events.reset_index(drop=True),
                   {**graph.meta, **meta})  # fmt: skip


class GraphCache:
    """Traced graphs on disk, one folder per configuration key; failures are cached too."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.traced = 0
        self.seconds = 0.0
        self.stale = 0  # loaded graphs traced by other tracer/zoo code than the current
        self.source = tracer_source_hash()

    def get(self, cfg: TraceConfig) -> OpGraph | str:
        """The graph, or the error text of a configuration that cannot be traced."""
        path = self.dir / cfg.key()
        if (path / "meta.json").exists():
            graph = OpGraph.load(path)
            self.stale += graph.meta.get("tracer_source") != self.source
            return graph
        failed = path / "failed.json"
        if failed.exists():
            return json.loads(failed.read_text())["error"]
        started = time.perf_counter()
        try:
            graph = trace_config(cfg)
        except Exception as exc:  # noqa: BLE001 - any model that fails to build/trace is skipped
            path.mkdir(parents=True, exist_ok=True)
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            failed.write_text(json.dumps({"config": asdict(cfg), "error": error}))
            return error
        finally:
            self.traced += 1
            self.seconds += time.perf_counter() - started
        graph.meta["trace_config"] = asdict(cfg)
        graph.meta["tracer_source"] = self.source
        graph.save(path)
        return graph


def tracer_source_hash() -> str:
    """Hash of the tracer and zoo code (the trace cache's ``code_digest``). Not part of the
    cache key, on purpose: a retrace of everything takes ~10 min here, and most tracer edits
    do not change the ops; stale entries are counted and reported instead (delete the cache
    folder to retrace)."""
    from boom_ml.trace_cache import code_digest

    return code_digest()[:12]


def row_trace_config(row: pd.Series) -> TraceConfig:
    opt = str(row["optimizer"]) if pd.notna(row["optimizer"]) else "none"
    src = str(row["source"])
    untimed = src in ZERO_GRAD_UNTIMED and row["phase_scope"] != "fwd"
    zero = str(row.get("run_id")) in ZERO_GRAD_RUNS.get(src, ()) or untimed
    return TraceConfig(
        model=str(row["model"]),
        batch_size=int(row["batch_size"]),
        seq_len=int(row["seq_len"]) if pd.notna(row["seq_len"]) else None,
        image_size=int(row["image_size"]) if pd.notna(row["image_size"]) else None,
        optimizer=OPTIMIZER_ALIASES.get((row["source"], opt), opt),
        amp=str(row["amp"]) if pd.notna(row["amp"]) else "none",
        checkpointing=str(row["checkpointing"]) if pd.notna(row["checkpointing"]) else "none",
        half=row["precision"] == "float16",
        forward_only=row["phase_scope"] == "fwd",
        attention=SOURCE_ATTENTION.get(str(row["source"]), "sdpa"),
        zero_grad="zero" if zero else "set_to_none",
        zero_grad_timed=not untimed,
    )


def row_tf32(row: pd.Series) -> Tf32:
    """TF32 switches as recorded, else PyTorch's defaults in the release that measured the row.

    A recorded flag sets both switches (our harness, ``data_collection.environment.set_tf32``).
    Importers leave it empty only on Ampere and later; then the release decides: 1.7-1.11 ran
    fp32 matmuls and convolutions on TF32, from 1.12 matmuls are off and cuDNN stays on
    (cnn_step_times' A100 run: 1.7; timm's RTX 3090 run: 1.12; NeuSight's labels: 2.1.0, its
    SOURCE.md turns cuDNN TF32 off only for the per-op tables). A wrong matmul "on" makes an
    fp32 transformer 8x too fast on an A100 in the per-op sum.
    """
    if pd.notna(row["tf32"]):
        return Tf32.of(bool(row["tf32"]))
    version = row.get("torch_version")
    version = str(version) if pd.notna(version) else SOURCE_TORCH.get(str(row["source"]), "")
    return from_torch_version(version) if version else Tf32(matmul=False, cudnn=False)
