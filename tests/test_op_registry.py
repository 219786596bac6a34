"""The op registry: every op the zoo's models trace has an entry; families are exact names."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.timing import features, per_op, roofline
from boom_ml.timing.gnn_features import FAMILIES as GNN_FAMILIES
from boom_ml.trace.families import FAMILIES
from boom_ml.trace.ops import (
    EXTRA_FLOP_SHAPE_FORMULAS,
    MISSING,
    REGISTRY,
    entry_of,
    family_of,
    packet_name,
)
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model
from boom_ml.zoo.base import BuiltModel
from data_collection import schema
from data_collection.importers import neusight
from data_collection.kernel_ops import REGISTRY as HARNESS_OPS

aten = torch.ops.aten

# Representative zoo models, shrunk where the zoo takes config options: CNNs with max and
# adaptive pooling, depthwise convs with hard activations, ConvNeXt, ViT, GPT-2, BERT, T5
# and Llama, under AMP, checkpointing and each optimizer family.
ZOO_STEPS = [
    ("torchvision:resnet18", {}, StepSpec(batch_size=2, image_size=64, optimizer="adamw")),
    ("torchvision:resnet18", {}, StepSpec(batch_size=2, image_size=64, amp="fp16",
                                          checkpointing="full", optimizer="sgd-momentum")),
    ("torchvision:vgg11", {"num_classes": 10}, StepSpec(batch_size=2, image_size=32,
                                                        optimizer="adagrad")),
    ("torchvision:mobilenet_v3_small", {}, StepSpec(batch_size=2, image_size=64, amp="bf16",
                                                    optimizer="rmsprop")),
    ("torchvision:convnext_tiny", {}, StepSpec(batch_size=1, image_size=64, optimizer="adam")),
    ("torchvision:vit_b_16", {"image_size": 32}, StepSpec(batch_size=1, image_size=32)),
    ("hf:gpt2", {"n_layer": 1}, StepSpec(batch_size=2, seq_len=32, amp="fp16")),
    ("hf:gpt2", {"n_layer": 1}, StepSpec(batch_size=2, seq_len=32, checkpointing="full",
                                         optimizer="adafactor")),
    ("hf:bert-base-uncased", {"num_hidden_layers": 1}, StepSpec(batch_size=2, seq_len=32,
                                                                 amp="bf16")),
    ("hf:t5-small", {"num_layers": 1, "num_decoder_layers": 1}, StepSpec(batch_size=2, seq_len=32)),
    ("hf:meta-llama/Llama-3.2-1B",
     {"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 512,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000},
     StepSpec(batch_size=1, seq_len=32, amp="bf16", checkpointing="full")),
]  # fmt: skip


@pytest.fixture(scope="module")
def zoo_ops() -> dict[str, str]:
    """Every aten op traced in ZOO_STEPS → the first model that traced it."""
    seen: dict[str, str] = {}
    for name, options, step in ZOO_STEPS:
        graph = trace_step(build_model(ModelSpec(name, options)), step)
        for aten_op in graph.nodes["aten_op"]:
            seen.setdefault(aten_op.rsplit(".", 1)[0], name)
    return seen


def test_every_zoo_op_has_an_entry(zoo_ops) -> None:
    unknown = {op: model for op, model in zoo_ops.items() if family_of(_packet(op)) == "other"}
    assert not unknown, f"ops without a registry entry (op: first model): {unknown}"
    assert len(zoo_ops) > 80  # the models above really were traced


def test_zoo_ops_get_their_family(zoo_ops) -> None:
    # The prefix tables put max_pool2d_with_indices, maximum and minimum among reductions
    # and _adaptive_avg_pool2d among elementwise ops.
    expected = {
        "aten.max_pool2d_with_indices": "pooling",
        "aten.max_pool2d_with_indices_backward": "pooling",
        "aten._adaptive_avg_pool2d": "pooling",
        "aten.minimum": "elementwise",
        "aten.mm": "gemm",
        "aten.convolution": "conv",
        "aten.native_batch_norm": "norm",
        "aten._scaled_dot_product_efficient_attention": "attention",
        "aten.nll_loss_forward": "loss",
        "aten.sum": "reduction",
        "aten._foreach_add_": "optimizer",
        "aten._to_copy": "copy",
        "aten.ones_like": "fill",
        "aten.embedding_dense_backward": "embedding",
        "aten._log_softmax": "softmax",
    }
    assert set(expected) <= set(zoo_ops)
    assert {op: family_of(_packet(op)) for op in expected} == expected
    assert family_of(aten.maximum) == "elementwise"


def test_registry_entries() -> None:
    assert MISSING == []  # every registered name exists in the pinned PyTorch
    assert {e.family for e in REGISTRY.values()} <= set(FAMILIES) - {"other", "host"}
    conv = entry_of(aten.convolution.default)
    assert (conv.cuda_name, conv.family) == ("cudnn_convolution", "conv")
    cpu_flash = entry_of(aten._scaled_dot_product_flash_attention_for_cpu)
    assert cpu_flash.cuda_name == "_scaled_dot_product_flash_attention"
    assert cpu_flash.flops is not None
    assert entry_of(aten.native_batch_norm_backward).cuda_name == "cudnn_batch_norm_backward"
    assert not entry_of(aten.view).kernel and not entry_of(aten.view).allocates
    assert entry_of(aten.empty_strided).allocates and not entry_of(aten.empty_strided).kernel
    # torch's FLOP formulas are the entries' own, for every op torch counts, except where
    # ours replace them on purpose (SDPA: causal attention counts the kept pairs only,
    # tests/test_attention_backend.py)
    for packet, formula in flop_registry.items():
        if isinstance(packet, torch._ops.OpOverloadPacket):
            ours = packet in EXTRA_FLOP_SHAPE_FORMULAS
            assert (REGISTRY[packet].flops is formula) != ours, packet_name(packet)


def test_families_consumed_downstream_are_registry_families() -> None:
    assert GNN_FAMILIES is FAMILIES  # the GNN's one-hot columns, in this order
    assert set(features.FAMILY_HEAD) == set(FAMILIES) - {"host"}
    assert roofline.MATRIX_FAMILIES | roofline.NO_GPU_FAMILIES <= set(FAMILIES)
    assert per_op.COUNTED_FAMILIES | per_op.NO_TIME_FAMILIES <= set(FAMILIES)
    assert set(schema.FAMILIES) <= set(FAMILIES)
    assert {op.family for op in HARNESS_OPS.values()} <= set(schema.FAMILIES)
    assert HARNESS_OPS["linear"].family == "gemm" and HARNESS_OPS["dropout"].family == "elementwise"
    # An importer's canonical op that is a registered aten op carries the registry's family.
    labelled = [(o, f) for o, f in neusight.OPS.values() if getattr(aten, o, None) in REGISTRY]
    assert {op for op, _ in labelled} >= {"bmm", "add", "gelu"}
    assert [(op, entry_of(getattr(aten, op)).family) for op, _ in labelled] == labelled


@torch.library.custom_op("boomtest::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _UsesCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.lin(_twice(_twice(input)))  # on the input: no gradient flows through it


def test_unknown_op_is_other_and_counted() -> None:
    with torch.device("meta"):
        module = _UsesCustomOp()
    built = BuiltModel(
        ModelSpec("test:custom-op"),
        module,
        "mlp",
        lambda step, device: {"input": torch.randn(step.batch_size, 8, device=device)},
        lambda out, inp: out.square().mean(),
        lambda m: None,
    )
    graph = trace_step(built, StepSpec(batch_size=4, optimizer="sgd"))
    custom = graph.nodes[graph.nodes["aten_op"].str.startswith("boomtest.twice")]
    assert list(custom["family"]) == ["other", "other"]
    assert list(custom["op"]) == ["twice", "twice"]
    assert graph.unknown_ops == {"twice": 2}


def _packet(name: str) -> torch._ops.OpOverloadPacket:
    namespace, _, op = name.rpartition(".")
    return getattr(getattr(torch.ops, namespace), op)


def test_explain_names_unknown_ops() -> None:
    import boom_ml
    from boom_ml.report.table import render_table

    prediction = boom_ml.predict(
        model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=64, advice=False
    )
    line = "ops without an op-registry entry (family 'other'): twice x2, scan x1"
    prediction.graph["unknown_ops"] = {}
    assert "op-registry" not in render_table(prediction, explain=True)
    prediction.graph["unknown_ops"] = {"twice": 2, "scan": 1}
    assert line in render_table(prediction, explain=True).splitlines()
    assert line not in render_table(prediction, explain=False)
