"""timm models under checkpointing=selective and checkpointing.every=K: timm's own switch
(checkpoint_seq) cannot be told which blocks or how, so the blocks are wrapped one by one."""

from __future__ import annotations

import pandas as pd

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model


def trace(model: str, options: dict, **step: object) -> object:
    return trace_step(build_model(ModelSpec(model, options)), StepSpec(batch_size=2, **step))


def _recomputed(graph: object) -> pd.DataFrame:
    return graph.nodes[graph.nodes.phase == "recompute"]


def test_timm_checkpoints_block_by_block_for_selective_and_every_k() -> None:
    """timm's own switch (checkpoint_seq) serves checkpointing=full; selective and every=K
    wrap its blocks one by one instead (a helper found them refused on a ViT)."""
    model, opts = "timm:vit_tiny_patch16_224", {"depth": 4, "img_size": 32}
    kw = {"image_size": 32}
    full = trace(model, opts, checkpointing="full", **kw)
    assert full.meta["recipe"]["checkpointed_blocks"] == 0  # timm's checkpoint_seq did it
    every = trace(model, opts, checkpointing="full", checkpointing_every=2, **kw)
    assert every.meta["recipe"]["checkpointed_blocks"] == 2
    assert {m.split("blocks.")[1].split(".")[0] for m in _recomputed(every).module} == {"0", "2"}
    selective = trace(model, opts, checkpointing="selective", **kw)
    assert selective.meta["recipe"]["checkpointed_blocks"] == 4
    recomputed = _recomputed(selective)
    assert len(recomputed) and not {"gemm", "attention"} & set(recomputed.family)
