"""Repeated blocks folded in module lists (``boom_ml/trace/module_paths.py``).

Paths and values here are made up for the tests (synthetic), as are the tiny traced models.
"""

from __future__ import annotations

import pytest
from tiny_models import tiny_cnn

from boom_ml.gpus import get_gpu
from boom_ml.memory.estimate import estimate_memory
from boom_ml.specs import StepSpec
from boom_ml.timing.estimate import estimate_time
from boom_ml.trace.module_paths import block_kinds, block_totals, group_by_block
from boom_ml.trace.step import trace_step

GPT = [
    "GPT2LMHeadModel.transformer.h.0.attn",
    "GPT2LMHeadModel.transformer.h.0.mlp.c_fc",
    "GPT2LMHeadModel.transformer.h.0",
    "GPT2LMHeadModel.transformer.h.11.attn",
    "GPT2LMHeadModel.transformer.h.11.mlp.c_fc",
    "GPT2LMHeadModel.transformer.h.11",
    "GPT2LMHeadModel.lm_head",
]


def test_numbered_blocks_fold_and_plain_sequential_layers_stay_apart() -> None:
    kinds = block_kinds(
        GPT
        + ["VGG.features.0", "VGG.features.1", "VGG.classifier.3"]
        + ["ViT.encoder.layers.encoder_layer_0.mlp", "ViT.encoder.layers.encoder_layer_7.mlp"]
        + ["Swin.features.1.0.attn", "Swin.features.1.1.attn", "Swin.features.3.0.attn"]
        + ["(top level)", ""]
    )
    assert kinds["GPT2LMHeadModel.transformer.h.11.attn"] == "GPT2LMHeadModel.transformer.h.*.attn"
    assert kinds["GPT2LMHeadModel.transformer.h.0"] == "GPT2LMHeadModel.transformer.h.*"
    assert kinds["GPT2LMHeadModel.transformer.h.0.mlp.c_fc"] == (
        "GPT2LMHeadModel.transformer.h.*.mlp.c_fc"
    )
    assert kinds["GPT2LMHeadModel.lm_head"] == "GPT2LMHeadModel.lm_head"
    # a conv and a ReLU of one nn.Sequential are different layers, not copies of a block
    assert kinds["VGG.features.0"] == "VGG.features.0"
    assert kinds["VGG.classifier.3"] == "VGG.classifier.3"
    assert (
        kinds["ViT.encoder.layers.encoder_layer_7.mlp"] == "ViT.encoder.layers.encoder_layer_*.mlp"
    )
    # nested indices fold level by level: stages and the blocks inside them
    assert {kinds[p] for p in ("Swin.features.1.0.attn", "Swin.features.3.0.attn")} == {
        "Swin.features.*.*.attn"
    }
    assert kinds["(top level)"] == "(top level)" and kinds[""] == ""


def test_blocks_alone_fold_when_the_model_says_they_have_children() -> None:
    """At a checkpointed step's peak only each layer's saved input is live, under the layer's
    own path: the graph's other modules say the layers are blocks."""
    layers = [(f"Llama.model.layers.{i}", 8.0) for i in range(15)] + [("Llama.lm_head", 100.0)]
    assert group_by_block(layers, "bytes")[1] == {"module": "Llama.model.layers.0", "blocks": 1,
                                                  "bytes": 8.0}  # fmt: skip
    known = [f"Llama.model.layers.{i}.self_attn" for i in range(15)] + ["Llama.lm_head"]
    assert group_by_block(layers, "bytes", known=known) == [
        {"module": "Llama.model.layers.*", "blocks": 15, "bytes": 120.0},
        {"module": "Llama.lm_head", "blocks": 1, "bytes": 100.0},
    ]


def test_group_by_block_sums_counts_and_ranks() -> None:
    values = list(zip(GPT, [4.0, 2.0, 0.5, 4.5, 2.5, 0.25, 3.0], strict=True))
    groups = group_by_block(values, "ms")
    assert groups == [
        {"module": "GPT2LMHeadModel.transformer.h.*.attn", "blocks": 2, "ms": 8.5},
        {"module": "GPT2LMHeadModel.transformer.h.*.mlp.c_fc", "blocks": 2, "ms": 4.5},
        {"module": "GPT2LMHeadModel.lm_head", "blocks": 1, "ms": 3.0},
        {"module": "GPT2LMHeadModel.transformer.h.*", "blocks": 2, "ms": 0.75},
    ]
    assert group_by_block(values, "ms", top_n=1) == groups[:1]


def test_block_totals_sum_whole_blocks_children_included() -> None:
    values = list(zip(GPT, [4.0, 2.0, 0.5, 4.5, 2.5, 0.25, 3.0], strict=True))
    assert block_totals(values, "ms") == [
        {"module": "GPT2LMHeadModel.transformer.h.*", "blocks": 2, "ms": 13.75}
    ]  # lm_head is in no repeated block
    stages = [("Swin.features.1.0.attn", 1.0), ("Swin.features.1.1.attn", 2.0),
              ("Swin.features.3.0.attn", 4.0), ("Swin.head", 8.0)]  # fmt: skip
    assert block_totals(stages, "ms") == [{"module": "Swin.features.*", "blocks": 2, "ms": 7.0}]


def test_time_and_memory_estimates_fold_the_traced_blocks() -> None:
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="adamw"))
    gpu = get_gpu("a100-80gb-sxm")
    est = estimate_time(graph, gpu, top_n=1000)
    per_module = {m["module"]: m["ms"] for m in est.top_modules}
    convs = [m for m in per_module if m.endswith(".0") and ".blocks." in m]
    assert len(convs) == 2  # blocks.0.0 and blocks.1.0: the first layer of each block
    kind = block_kinds(per_module)[convs[0]]
    assert kind.endswith(".blocks.*.0")
    group = next(g for g in est.top_module_groups if g["module"] == kind)
    assert group["blocks"] == 2
    assert group["ms"] == pytest.approx(sum(per_module[m] for m in convs), abs=1e-3)
    assert sum(g["ms"] for g in est.top_module_groups) == pytest.approx(
        sum(per_module.values()), abs=1e-3
    )
    (blocks,) = est.block_totals  # TinyCnn.blocks.0 and .1, children included
    assert blocks["blocks"] == 2 and blocks["module"].endswith(".blocks.*")
    in_blocks = [ms for m, ms in per_module.items() if ".blocks." in m]
    assert blocks["ms"] == pytest.approx(sum(in_blocks), abs=1e-3)

    mem = estimate_memory(graph, gpu, top_modules=1000)
    assert sum(g["bytes"] for g in mem.by_module_group) == sum(m["bytes"] for m in mem.by_module)
    assert any(g["blocks"] == 2 for g in mem.by_module_group)


def test_explain_table_lists_block_kinds_with_their_count() -> None:
    import boom_ml
    from boom_ml.report.table import render_table

    prediction = boom_ml.predict(
        model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=64, advice=False
    )
    lines = render_table(prediction, explain=True).splitlines()
    conv = [line.split() for line in lines if line.strip().startswith("ResNet.layer4.*.conv2 ")]
    assert len(conv) == 1 and conv[0][-1] == "x2"  # resnet18's layer4 holds two BasicBlocks
    assert not any("ResNet.layer4.0.conv2" in line for line in lines)
    assert any(line.startswith("  whole blocks: ResNet.layer4.* x2, ") for line in lines)
    # one micro-batch is the step: shares of the step, no word of micro-batches
    assert any(line.endswith("% of the step)") for line in lines)
    assert not any("micro-batch" in line for line in lines)


def test_explain_under_accumulation_speaks_of_one_micro_batch() -> None:
    """The ops, modules and blocks are one micro-batch's: their share is of a micro-batch,
    not of the step that runs several."""
    import re

    import boom_ml
    from boom_ml.report.table import render_table

    prediction = boom_ml.predict(model="torchvision:resnet18", gpu="l4", batch_size=2,
                                 image_size=64, advice=False, grad_accum=3)  # fmt: skip
    t = prediction.gpus[0].time
    lines = render_table(prediction, explain=True).splitlines()
    once = t.by_phase["optimizer"] + t.by_phase.get("zero_grad", 0.0)
    assert t.accumulate_ms > 0  # micro-batches 2 and 3 add into the kept gradients
    assert (
        f"  ops, modules and blocks below are one micro-batch's ({t.micro_step_ms:.1f} ms, run 3 "
        f"times, each after the first adding {t.accumulate_ms:.2f} ms into the kept gradients) "
        f"and the optimizer step's ({once:.1f} ms, run once)"
    ) in lines
    (block,) = [line for line in lines if line.startswith("  whole blocks: ResNet.layer4.* x2, ")]
    share = float(re.search(r"\(([\d.]+) % of a micro-batch\)", block).group(1))
    (ms,) = [b["ms"] for b in t.block_totals if b["module"] == "ResNet.layer4.*"]
    assert share == pytest.approx(100 * ms / t.micro_step_ms, abs=0.06)


def test_plot_labels_drop_the_root_class_and_keep_the_tail() -> None:
    from boom_ml.report.time_plots import _short

    assert _short("GPT2LMHeadModel.transformer.h.*.mlp.c_proj") == "transformer.h.*.mlp.c_proj"
    assert _short("GPT2LMHeadModel") == "GPT2LMHeadModel"
    assert _short("(parameters, gradients, optimizer state)", width=12) == "…izer state)"
    assert _short("M.encoder.layers.encoder_layer_*.mlp", width=20) == "…encoder_layer_*.mlp"


def test_explain_and_plots_describe_the_same_gpu(tmp_path) -> None:
    """The RTX 4090 is faster than the RTX A6000 but does not hold resnet18 at batch 1200:
    explain=true and plot= both describe the A6000, the fastest GPU that fits."""
    import boom_ml
    from boom_ml.report.table import render_table

    prediction = boom_ml.predict(model="torchvision:resnet18", gpu=["rtx-4090", "rtx-a6000"],
                                 batch_size=1200, advice=False, max_batch="off",
                                 plot=str(tmp_path))  # fmt: skip
    fits = {g.gpu: g.fits for g in prediction.gpus}
    step = {g.gpu: g.time.step_ms for g in prediction.gpus}
    assert fits == {"rtx-4090": False, "rtx-a6000": True} and step["rtx-4090"] < step["rtx-a6000"]
    lines = render_table(prediction, explain=True).splitlines()
    assert any(
        line.startswith("Explained: rtx-a6000, the fastest that fits of the 2") for line in lines
    )
    assert sorted(p.name for p in tmp_path.iterdir() if "a6000" in p.name) == [
        "torchvision_resnet18_memory_rtx-a6000.png",
        "torchvision_resnet18_time_rtx-a6000.png",
    ]


def test_explain_names_the_gnn_overhead_its_lists_leave_out() -> None:
    """Under the GNN a per-step overhead is part of step_ms and of no op, module or phase
    (37 % of resnet18's 7.8 ms at 32 x 64 px on an A100): explain says so."""
    import boom_ml
    from boom_ml.report.table import render_table

    p = boom_ml.predict(model="torchvision:resnet18", gpu="a100-80gb-sxm", batch_size=32,
                        image_size=64, advice=False, max_batch="off")  # fmt: skip
    t = p.gpus[0].time
    assert t.method == "gnn" and t.overhead_ms > 0
    assert sum(t.by_phase.values()) + t.overhead_ms == pytest.approx(t.step_ms, abs=1e-3)
    line = f"  of which {t.overhead_ms:.2f} ms is the GNN's per-step overhead"
    assert any(x.startswith(line) for x in render_table(p, explain=True).splitlines())
