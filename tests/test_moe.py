"""Mixture-of-experts configs trace with even, deterministic routing; NeuSight's configs trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.step import reference_flops, trace_step
from boom_ml.zoo import build_model
from boom_ml.zoo.hf_moe import expert_loads
from data_collection.paths import shared_data_dir

NEUSIGHT_CONFIGS = shared_data_dir() / "neusight" / "model_configs"
NEUSIGHT_FILES = sorted(NEUSIGHT_CONFIGS.glob("*.json")) if NEUSIGHT_CONFIGS.is_dir() else []

# A synthetic Mixtral-style config, shrunk so a step traces in a second: not a real model.
TINY_MIXTRAL = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


def test_expert_loads_even_and_imbalanced() -> None:
    assert expert_loads(40, 4, 20) == [10, 10, 10, 10]
    assert expert_loads(10, 4, 10) == [3, 3, 2, 2]  # the remainder goes to the first experts
    assert expert_loads(40, 4, 20, imbalance=2.0) == [20, 7, 7, 6]
    assert expert_loads(40, 4, 15, imbalance=2.0) == [15, 7, 7, 6]  # one token, one visit
    assert expert_loads(512, 4, 64) == [64, 64, 64, 64]  # Switch capacity drops the overflow
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(InvalidInputError, match="moe_imbalance must be a finite number"):
            expert_loads(40, 4, 20, imbalance=bad)


def test_top_k_routing_keeps_every_pair_so_its_imbalance_is_bounded() -> None:
    """Top-2 of 8 experts over 20 tokens: 40 pairs; the busiest expert can take all 20 tokens
    (imbalance 4), the others share the 20 pairs left; beyond 4 it would take more tokens than
    there are, which routing cannot keep (capacity-free top-k drops none): an error."""
    from boom_ml.zoo.hf_moe import topk_loads

    assert topk_loads(20, 2, 8, 4.0) == [20, 3, 3, 3, 3, 3, 3, 2]
    assert sum(topk_loads(20, 2, 8, 3.0)) == 40
    with pytest.raises(InvalidInputError, match="at most 4 for 8 experts, top-2 routing"):
        topk_loads(20, 2, 8, 4.5)


def _tiny_mixtral(tmp_path: Path, **options: float) -> ModelSpec:
    path = tmp_path / "tiny_mixtral_synthetic.json"
    path.write_text(json.dumps(TINY_MIXTRAL))
    return ModelSpec(f"hf:{path}", dict(options))


def _expert_gemm_flops(graph, phase: str) -> list[int]:
    nodes = graph.nodes
    mine = nodes[
        (nodes.phase == phase) & nodes.module.str.endswith("mlp.experts") & (nodes.op == "bmm")
    ]
    return [int(f) for f in mine.flops]


def test_tiny_moe_expert_flops_equal_even_routing(tmp_path: Path) -> None:
    built = build_model(_tiny_mixtral(tmp_path))
    assert built.info["moe_layers"] == 2 and built.info["moe_imbalance"] == 1.0
    batch, seq = 2, 10
    graph = trace_step(built, StepSpec(batch_size=batch, seq_len=seq, optimizer="none"))
    hidden, inter = TINY_MIXTRAL["hidden_size"], TINY_MIXTRAL["intermediate_size"]
    top_k = TINY_MIXTRAL["num_experts_per_tok"]
    pairs = batch * seq * top_k  # 40 token-expert pairs, 10 per expert
    # even loads: one batched GEMM per projection over all 4 experts
    gate_up = 2 * pairs * hidden * 2 * inter
    down = 2 * pairs * inter * hidden
    layers = TINY_MIXTRAL["num_hidden_layers"]
    assert _expert_gemm_flops(graph, "forward") == [gate_up, down] * layers
    # backward: input and weight gradients of both projections, twice the forward
    assert sum(_expert_gemm_flops(graph, "backward")) == 2 * (gate_up + down) * layers


def test_moe_imbalance_scales_busiest_expert(tmp_path: Path) -> None:
    built = build_model(_tiny_mixtral(tmp_path, moe_imbalance=2.0))
    graph = trace_step(built, StepSpec(batch_size=2, seq_len=10, optimizer="none"))
    hidden, inter = TINY_MIXTRAL["hidden_size"], TINY_MIXTRAL["intermediate_size"]
    first_layer = _expert_gemm_flops(graph, "forward")[:6]
    # runs of equal loads [20], [7, 7], [6]: one gate_up and one down GEMM each
    tokens = [f // (2 * hidden * 2 * inter) for f in first_layer[0::2]]
    assert expert_loads(40, 4, 20, imbalance=2.0) == [20, 7, 7, 6]
    assert tokens == [20, 14, 6]


def test_attn_implementation_option(tmp_path: Path) -> None:
    spec = _tiny_mixtral(tmp_path, attn_implementation="eager")
    assert build_model(spec).module.config._attn_implementation == "eager"
    assert build_model(_tiny_mixtral(tmp_path)).info["attn_implementation"] == "sdpa"
    with pytest.raises(
        InvalidInputError, match="unknown attention 'flash'; choose one of: sdpa, eager"
    ):
        build_model(_tiny_mixtral(tmp_path, attn_implementation="flash"))


def test_neusight_configs_are_all_there() -> None:
    """The parametrised test below runs over these; an empty glob would run none of it."""
    assert len(NEUSIGHT_FILES) == 12, NEUSIGHT_CONFIGS


@pytest.mark.parametrize("path", NEUSIGHT_FILES, ids=lambda p: p.stem)
def test_neusight_config_traces(path: Path) -> None:
    """Every NeuSight model config (switchxl4 is a Switch Transformer MoE) traces at batch 1,
    its FLOPs those PyTorch's FlopCounterMode counts on the same step."""
    spec = ModelSpec(f"hf:{path}", {"attn_implementation": "eager"})
    step = StepSpec(batch_size=1, seq_len=32, optimizer="none")
    built = build_model(spec)
    graph = trace_step(built, step)
    assert graph.flops == reference_flops(build_model(spec), step) > 0
    raw = json.loads(path.read_text())
    if raw["model_type"] == "switch_transformers":
        # 12 sparse layers in each stack, every one routed by hf_moe
        assert built.info["moe_layers"] == 24


def test_hf_build_options_elsewhere_only_at_their_defaults() -> None:
    """A caller may always pass the hf build options; other schemes drop the defaults."""
    defaults = {"attn_implementation": "sdpa", "moe_imbalance": 1.0}
    built = build_model(ModelSpec("torchvision:resnet18", defaults))
    assert type(built.module).__name__ == "ResNet"
    with pytest.raises(InvalidInputError, match="moe.imbalance=2.0 applies to hf: models only"):
        build_model(ModelSpec("torchvision:resnet18", {"moe_imbalance": 2.0}))
    with pytest.raises(InvalidInputError, match="attention=eager applies to hf: models only"):
        build_model(ModelSpec("torchvision:resnet18", {"attn_implementation": "eager"}))


def test_moe_imbalance_on_a_dense_model_is_refused() -> None:
    """A skew with no experts to skew would be ignored without a word."""
    with pytest.raises(InvalidInputError, match="hf:gpt2 has no mixture-of-experts layers"):
        build_model(ModelSpec("hf:gpt2", {"moe_imbalance": 1.5}))
    assert build_model(ModelSpec("hf:gpt2", {"moe_imbalance": 1.0})).info["moe_layers"] == 0


# A synthetic DBRX-style config (stacked expert weights, its own expert loop), shrunk.
TINY_DBRX = {
    "model_type": "dbrx",
    "architectures": ["DbrxForCausalLM"],
    "d_model": 64,
    "n_heads": 4,
    "n_layers": 2,
    "max_seq_len": 256,
    "vocab_size": 128,
    "attn_config": {"clip_qkv": 8, "kv_n_heads": 2, "rope_theta": 500000},
    "ffn_config": {"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2},
}


def test_dbrx_experts_route_evenly(tmp_path: Path) -> None:
    """DBRX's expert loop asks nonzero() / torch.where which experts got which tokens: it
    failed (DynamicOutputShapeException on aten.nonzero); it now routes evenly like the
    other MoE layers, one gather + GLU + index_add_ per expert."""
    path = tmp_path / "tiny_dbrx_synthetic.json"
    path.write_text(json.dumps(TINY_DBRX))
    built = build_model(f"hf:{path}")
    assert built.info["moe_layers"] == 2
    batch, seq = 2, 10
    graph = trace_step(built, StepSpec(batch_size=batch, seq_len=seq, optimizer="none"))
    nodes = graph.nodes
    experts = nodes[(nodes.phase == "forward") & nodes.module.str.contains("experts")]
    hidden, ffn = TINY_DBRX["d_model"], TINY_DBRX["ffn_config"]["ffn_hidden_size"]
    pairs = batch * seq * TINY_DBRX["ffn_config"]["moe_top_k"]  # 40 pairs, 10 per expert
    gemms = experts[experts.op.isin(["mm", "matmul", "bmm"])]
    assert len(gemms) == 3 * 4 * 2  # w1, v1, w2 for each of 4 experts in 2 layers
    assert int(gemms.flops.sum()) == 3 * 2 * pairs * hidden * ffn * 2


def test_qlora_names_dbrxs_stacked_experts_as_unquantised(tmp_path: Path) -> None:
    """DBRX keeps its experts as 2-D stacks (experts x ffn rows): not nn.Linear, so not
    quantised, and the recipe counts them: w1, v1, w2 of 4 experts in each of 2 layers."""
    from boom_ml.zoo.finetune import apply_recipe

    path = tmp_path / "tiny_dbrx_synthetic.json"
    path.write_text(json.dumps(TINY_DBRX))
    module = build_model(f"hf:{path}").module
    facts = apply_recipe(module, StepSpec(finetune_method="qlora", lora_targets=("Wqkv",)))
    hidden, ffn = TINY_DBRX["d_model"], TINY_DBRX["ffn_config"]["ffn_hidden_size"]
    assert facts["unquantized_expert_parameters"] == 2 * 3 * 4 * ffn * hidden


def test_moe_imbalance_is_kept_where_a_cut_of_a_moe_model_has_no_experts() -> None:
    """A pipeline rank's first layer of DeepSeek-V2-Lite is dense (first_k_dense_replace=1):
    the skew is the model's, not refused because that cut routes nothing."""
    built = build_model(ModelSpec("hf:deepseek-ai/DeepSeek-V2-Lite",
                                  {"num_hidden_layers": 1, "moe_imbalance": 2.0}))  # fmt: skip
    assert built.info["moe_layers"] == 0
