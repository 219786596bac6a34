"""Recipes of issue #15: params_dtype, LoRA / QLoRA, selective and every-K checkpointing.

Every model here is a synthetic tiny config written by the test (``tiny_llama``, ``TINY_PHI3``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from tiny_models import tiny_llama_config

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model
from boom_ml.zoo.nf4 import nf4_bytes

# synthetic: 2 layers, hidden 64, MLP 128, 4 query heads and 2 KV heads of 16, vocab 1000
TINY_LLAMA = tiny_llama_config(vocab_size=1000, rope_theta=10000.0, tie_word_embeddings=False)
# (out, in) of each linear layer of one block of TINY_LLAMA
BLOCK_LINEARS = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("synthetic_tiny_llama") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return f"hf:{path}"


def trace(model: str, options: dict | None = None, **step: object) -> object:
    spec = ModelSpec(model, options or {})
    return trace_step(build_model(spec), StepSpec(batch_size=2, seq_len=32, **step))


def adopted_bytes(graph: object, category: str) -> int:
    """Bytes of the blocks the recorded step started with (parameters, grads, state)."""
    events = pd.DataFrame(graph.mem_events)
    held = events[(events.action == "alloc") & (events.phase == category)]
    return int(held.bytes.sum())


def peft_trainable(targets: list[str] | None, r: int) -> int:
    """peft's own count on a real (CPU) model of the same config."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=r, lora_alpha=16, lora_dropout=0.05, target_modules=targets)
    return get_peft_model(model, lora).get_nb_trainable_parameters()[0]


@pytest.mark.parametrize(
    "targets, r", [(None, 8), (["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], 4)]
)
def test_lora_trainable_parameters_equal_peft(tiny_llama: str, targets, r) -> None:
    expected = peft_trainable(targets, r)
    graph = trace(tiny_llama, finetune_method="lora", lora_r=r, lora_targets=targets)
    assert graph.meta["num_trainable_parameters"] == expected
    assert graph.meta["recipe"]["peft_trainable_parameters"] == expected
    # only the adapters have gradients and optimizer state (fp32: 4 bytes, AdamW: 2 states)
    assert adopted_bytes(graph, "gradient") == 4 * expected
    assert adopted_bytes(graph, "optimizer_state") == 2 * 4 * expected


def test_lora_default_targets_hand_count(tiny_llama: str) -> None:
    # peft's default for llama is q_proj and v_proj: r * (in + out) per adapted layer
    q, v = BLOCK_LINEARS[0], BLOCK_LINEARS[2]
    expected = 2 * 8 * (sum(q) + sum(v))
    assert trace(tiny_llama, finetune_method="lora").meta["num_trainable_parameters"] == expected


def test_nf4_bytes_of_a_shape() -> None:
    # 4096 x 4096: 2^24 weights, 2^18 blocks of 64, 2^10 second-level blocks of 256
    packed, blocks = 2**23, 2**18
    with_dq = packed + blocks + 4 * 2**10 + 4 * 256 + 4 + 4 * 16
    assert nf4_bytes(4096, 4096, double_quant=True) == with_dq == 8_655_940
    assert nf4_bytes(4096, 4096, double_quant=False) == packed + 4 * blocks + 64 == 9_437_248
    # odd sizes round up: 3 x 5 = 15 weights -> 8 packed bytes, one block each level
    assert nf4_bytes(3, 5, double_quant=True) == 8 + 1 + 4 + 1024 + 4 + 64


@pytest.mark.parametrize("double_quant", [True, False])
def test_qlora_weights_are_nf4(tiny_llama: str, double_quant: bool) -> None:
    graph = trace(
        tiny_llama, finetune_method="qlora", params_dtype="bf16", double_quant=double_quant
    )
    layers = TINY_LLAMA["num_hidden_layers"]
    nf4 = layers * sum(nf4_bytes(o, i, double_quant) for o, i in BLOCK_LINEARS)
    hidden, vocab = TINY_LLAMA["hidden_size"], TINY_LLAMA["vocab_size"]
    norms = (2 * layers + 1) * hidden
    adapters = layers * 8 * (sum(BLOCK_LINEARS[0]) + sum(BLOCK_LINEARS[2]))
    rotary = 2 * 16 // 2  # inv_freq and original_inv_freq buffers, cast to bf16 with the model
    dense = 2 * vocab * hidden + norms + rotary  # embeddings, head: bf16
    # fp32 adapters, as peft's get_peft_model upcasts bf16 ones by default
    assert adopted_bytes(graph, "parameter") == nf4 + 2 * dense + 4 * adapters
    assert adopted_bytes(graph, "gradient") == 4 * adapters
    assert graph.meta["recipe"]["nf4_layers"] == layers * len(BLOCK_LINEARS)
    assert graph.meta["recipe"]["bytes"]["base_weights_4bit"] == nf4
    assert graph.meta["recipe"]["bytes"]["trainable_parameters"] == 4 * adapters
    assert graph.meta["recipe"]["adapter_dtypes"] == ["fp32"]
    assert graph.meta["method_notes"] and "NF4" in graph.meta["method_notes"][0]
    nodes = graph.nodes
    dequant = nodes[nodes.op == "dequantize_nf4"]
    assert (dequant.phase == "forward").sum() == layers * len(BLOCK_LINEARS)
    # backward dequantises again wherever an input gradient flows (not into the frozen
    # embedding: layer 0's q/k/v projections get none)
    assert (dequant.phase == "backward").sum() == layers * len(BLOCK_LINEARS) - 3


def test_bf16_true_is_two_bytes_per_element(tiny_llama: str) -> None:
    fp32 = trace(tiny_llama)
    bf16 = trace(tiny_llama, params_dtype="bf16", amp="none")
    n = fp32.meta["num_trainable_parameters"]
    assert bf16.meta["num_trainable_parameters"] == n
    assert adopted_bytes(fp32, "gradient") == 4 * n
    assert adopted_bytes(bf16, "gradient") == 2 * n
    assert adopted_bytes(bf16, "optimizer_state") == 2 * 2 * n  # AdamW: exp_avg, exp_avg_sq
    assert adopted_bytes(bf16, "parameter") == 2 * n + 2 * 16  # + the two rotary buffers
    gemms = bf16.nodes[bf16.nodes.family == "gemm"]
    assert all("bfloat16" in d and "float32" not in d for d in gemms.input_dtypes)


def _recomputed(graph: object) -> pd.DataFrame:
    return graph.nodes[graph.nodes.phase == "recompute"]


def test_selective_checkpointing_saves_matmul_outputs_only(tiny_llama: str) -> None:
    full = _recomputed(trace(tiny_llama, checkpointing="full"))
    selective = _recomputed(trace(tiny_llama, checkpointing="selective"))
    assert {"gemm", "attention"} <= set(full.family)
    assert not {"gemm", "attention"} & set(selective.family)
    # the rest (norms, activations, rotary, elementwise) is recomputed as under full
    rest = full[~full.family.isin(["gemm", "attention"])]
    assert len(selective) == len(rest) > 0


def test_every_second_block_is_checkpointed(tiny_llama: str) -> None:
    graph = trace(tiny_llama, {"num_hidden_layers": 4}, checkpointing="full", checkpointing_every=2)
    assert graph.meta["recipe"]["checkpointed_blocks"] == 2
    layers = {m.split("layers.")[1].split(".")[0] for m in _recomputed(graph).module}
    assert layers == {"0", "2"}
    every = trace(tiny_llama, {"num_hidden_layers": 4}, checkpointing="full")
    assert every.meta["recipe"]["checkpointed_blocks"] == 4


def test_t5_checkpoints_its_blocks_not_its_attention(tmp_path: Path) -> None:
    """T5's attention carries a gradient_checkpointing flag of its own (for its position
    bias); the blocks that run checkpoint are its two T5Blocks (one encoder, one decoder)."""
    path = tmp_path / "t5.json"
    path.write_text(json.dumps(TINY_OTHERS["t5"]))
    full = trace(f"hf:{path}", checkpointing="full")
    assert full.meta["recipe"]["checkpointed_blocks"] == 2
    every = trace(f"hf:{path}", checkpointing="full", checkpointing_every=2)
    assert every.meta["recipe"]["checkpointed_blocks"] == 1
    selective = _recomputed(trace(f"hf:{path}", checkpointing="selective"))
    assert len(selective) and not {"gemm", "attention"} & set(selective.family)
    assert {"gemm"} <= set(_recomputed(full).family)


def test_recipes_reject_bad_values() -> None:
    from boom_ml.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="params_dtype"):
        StepSpec(params_dtype="int8")
    with pytest.raises(InvalidInputError, match="finetune.method"):
        StepSpec(finetune_method="prefix")
    with pytest.raises(InvalidInputError, match="GradScaler"):
        StepSpec(params_dtype="fp16", amp="fp16")
    assert StepSpec(lora_targets=["q_proj"]).lora_targets == ("q_proj",)  # hashable


def test_api_finetune_mapping() -> None:
    from boom_ml.api import finetune_fields
    from boom_ml.errors import InvalidInputError

    fields = finetune_fields({"method": "qlora", "r": 16, "targets": "q_proj", "alpha": None})
    assert fields == {"finetune_method": "qlora", "lora_r": 16, "lora_targets": ["q_proj"]}
    with pytest.raises(InvalidInputError, match="rank"):
        finetune_fields({"rank": 4})
    # keys the method does not read, set away from their defaults, are refused
    for given, words in [({"r": 64}, "finetune.r applies to finetune.method=lora or qlora"),
                         ({"method": "lora", "double_quant": False}, "qlora, not lora"),
                         ({"method": "lora", "targets": []}, "names no module; leave it out"),
                         ({"method": "lora", "r": "8"}, "finetune.r must be an integer")]:  # fmt: skip
        with pytest.raises(InvalidInputError, match=words):
            finetune_fields(given)
    # the CLI passes every key at its default: those are not a user's setting
    assert finetune_fields({"method": "full", "r": 8, "alpha": 16, "dropout": 0.05,
                            "targets": None, "double_quant": True})["lora_r"] == 8  # fmt: skip
    assert torch.float32  # torch imported for the fake-mode trace above
    # a hunt: all-linear beside a module name had been told it "names no module"
    with pytest.raises(
        InvalidInputError, match=r"all-linear stands alone .* got \[all-linear,q_proj\]$"
    ):
        StepSpec(finetune_method="lora", lora_targets=["all-linear", "q_proj"])


def test_synthetic_config_is_what_it_says(tiny_llama: str) -> None:
    assert Path(tiny_llama.removeprefix("hf:")).parent.name.startswith("synthetic_tiny_llama")


def test_cli_keys_and_alias() -> None:
    from boom_ml.predict import config_keys, rewrite_aliases

    keys = config_keys()
    assert {"params_dtype", "checkpointing_every", "finetune.method", "finetune.r"} <= keys
    assert {"finetune.alpha", "finetune.dropout", "finetune.targets"} <= keys
    assert "finetune.double_quant" in keys
    assert rewrite_aliases(["checkpointing.every=2"]) == ["checkpointing_every=2"]


def test_bf16_true_time_takes_the_amp_cell(tiny_llama: str) -> None:
    """No GNN training row had low-precision matmuls without AMP: bf16-true steps take the
    verdict of the AMP cell (GNN or per-op), not that of fp32 steps."""
    from boom_ml.gpus import parse_gpu_list
    from boom_ml.timing.estimate import estimate_time

    gpu = parse_gpu_list("a100-80gb-sxm")[0]
    true_bf16 = estimate_time(trace(tiny_llama, params_dtype="bf16"), gpu).method
    amp = estimate_time(trace(tiny_llama, amp="bf16"), gpu).method
    fp32 = estimate_time(trace(tiny_llama), gpu).method
    assert true_bf16.split(" ")[0] == amp.split(" ")[0]
    assert fp32  # the fp32 cell may differ (today: gnn vs per-op)


def test_lora_with_checkpointing_traces_without_library_noise(tiny_llama: str) -> None:
    """peft reading transformers' deprecated alias, and ModTracker's re-entry warning on
    every recomputed block, used to reach the user's terminal; ModTracker also replaced
    warnings.formatwarning for the rest of the process."""
    import warnings

    before = warnings.formatwarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = trace(tiny_llama, checkpointing="full", finetune_method="lora")
    assert len(_recomputed(graph)) > 0
    noise = [
        str(w.message)
        for w in caught
        if "is_gradient_checkpointing" in str(w.message) or "hierarchy tracking" in str(w.message)
    ]
    assert noise == []
    assert warnings.formatwarning is before


def test_methods_line_says_a_shared_recipe_note_once() -> None:
    from boom_ml.report.table import methods_line

    note = "(qlora: NF4 weights and dequantise kernels analytic (bitsandbytes layout))"
    assert methods_line(f"allocator-sim {note}", f"per-op {note}") == (
        f"Memory: allocator-sim; time: per-op; both {note}"
    )
    assert methods_line("allocator-sim", "gnn") == "Memory: allocator-sim; time: gnn"
    assert (
        methods_line(f"allocator-sim {note}", "gnn") == f"Memory: allocator-sim {note}; time: gnn"
    )


# Synthetic tiny configs (not published models): GPT-2 (Conv1D layers), T5 (wo kept in fp32),
# Falcon (FalconLinear, an nn.Linear subclass), ViT (3-D position embeddings, no experts).
TINY_OTHERS = {
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32,
             "n_layer": 2, "n_head": 2, "vocab_size": 100, "n_positions": 64},
    "t5": {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 32,
           "d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 1, "num_decoder_layers": 1,
           "vocab_size": 100, "decoder_start_token_id": 0, "pad_token_id": 0,
           "eos_token_id": 1},
    "falcon": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 32,
               "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 100},
    "vit": {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
            "image_size": 32, "patch_size": 16},
}  # fmt: skip


def _qlora_facts(tmp_path: Path, kind: str) -> tuple[dict, torch.nn.Module]:
    from boom_ml.zoo.finetune import apply_recipe

    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(TINY_OTHERS[kind]))
    module = build_model(f"hf:{path}").module
    targets = {"gpt2": ["c_attn"], "t5": ["q", "v"], "falcon": None, "vit": None}[kind]
    step = StepSpec(finetune_method="qlora", lora_targets=targets)
    return apply_recipe(module, step), module


def test_qlora_quantises_what_transformers_quantises(tmp_path: Path) -> None:
    from boom_ml.zoo.nf4 import NF4Linear

    facts, module = _qlora_facts(tmp_path, "gpt2")
    # GPT-2's Conv1D layers, (out, in): c_attn (96, 32), c_proj (32, 32), c_fc (128, 32),
    # mlp.c_proj (32, 128), in each of 2 blocks; the tied head stays
    shapes = [(96, 32), (32, 32), (128, 32), (32, 128)]
    assert facts["nf4_layers"] == 2 * len(shapes)
    nf4 = [m for m in module.modules() if isinstance(m, NF4Linear)]
    assert sorted((m.out_features, m.in_features) for m in nf4) == sorted(shapes * 2)
    # T5 keeps wo unquantised (its _keep_in_fp32_modules): q k v o and wi of the encoder
    # block, q k v o twice and wi of the decoder block
    facts, module = _qlora_facts(tmp_path, "t5")
    assert facts["nf4_layers"] == 5 + 9
    assert all(type(m) is torch.nn.Linear for n, m in module.named_modules() if n.endswith(".wo"))
    # Falcon's layers are FalconLinear, which transformers does not convert: said, not hidden
    facts, _ = _qlora_facts(tmp_path, "falcon")
    assert facts["nf4_layers"] == 0
    assert (
        "no layer quantised" in facts["method_notes"][-1]
        and "FalconLinear" in facts["method_notes"][-1]
    )


def test_qlora_counts_only_fused_experts_as_unquantised_experts(tmp_path: Path) -> None:
    facts, _ = _qlora_facts(tmp_path, "vit")  # a 4-D patch conv and 3-D position embeddings
    assert "unquantized_expert_parameters" not in facts
    assert not any("MoE" in note for note in facts["method_notes"])


def test_a_lora_step_on_fp32_weights_is_offered_16_bit_frozen_weights() -> None:
    """LoRA over fp32 frozen weights went straight to QLoRA; half-precision frozen weights
    (bf16 on Ampere, fp16 before) come first; under fp16 autocast only where the adapters
    are fp32 (peft's default: GradScaler cannot unscale fp16 adapter gradients), and never
    for full training."""
    from boom_ml.gpus import get_gpu
    from boom_ml.report.levers import single_changes

    def offered(step: StepSpec, gpu: str) -> dict[str, StepSpec]:
        return {label: s for label, s, _ in single_changes(step, get_gpu(gpu))}

    lora = StepSpec(batch_size=4, finetune_method="lora", amp="bf16")
    on_a100 = offered(lora, "a100-80gb-sxm")
    changed = on_a100["params_dtype=bf16 (frozen weights in 16 bits)"]
    assert (changed.params_dtype, changed.amp, changed.finetune_method) == ("bf16", "bf16", "lora")
    plain = StepSpec(batch_size=4, finetune_method="lora")
    assert "params_dtype=fp16 (frozen weights in 16 bits)" in offered(plain, "v100-sxm2-16gb")
    fp16_amp = StepSpec(batch_size=4, finetune_method="lora", amp="fp16")
    assert "params_dtype=fp16 (frozen weights in 16 bits)" in offered(fp16_amp, "v100-sxm2-16gb")
    in_base = StepSpec(batch_size=4, finetune_method="lora", amp="fp16", adapter_dtype="params")
    assert not any(k.startswith("params_dtype") for k in offered(in_base, "v100-sxm2-16gb"))
    assert not any(k.startswith("params_dtype") for k in offered(StepSpec(batch_size=4), "l4"))


def test_16_bit_frozen_weights_do_not_stack_with_fp16_autocast() -> None:
    """On a GPU without bf16 a LoRA step over fp32 weights is offered amp=fp16 and fp16
    weights apart; stacked, they would be fp16 weights under fp16 autocast (GradScaler cannot
    unscale their gradients), which crashed the advice of a batch that nothing single fits.
    Since the twentieth session the 16-bit weights replace the autocast in the stack (they
    were skipped, the stack's biggest saving)."""
    from boom_ml.gpus import get_gpu
    from boom_ml.report.levers import single_changes, stacked_changes

    step, t4 = StepSpec(batch_size=512, finetune_method="lora"), get_gpu("t4")
    singles = [label for label, _, _ in single_changes(step, t4)]
    assert "amp=fp16" in singles and "params_dtype=fp16 (frozen weights in 16 bits)" in singles
    stacked = stacked_changes(step, t4)
    assert stacked and not any(s.amp == "fp16" and s.params_dtype == "fp16" for _, s, _ in stacked)
    assert stacked[0][0] == "params_dtype=fp16 + checkpointing=full"


def test_16_bit_frozen_weights_are_tried_on_the_split_that_fits_alone() -> None:
    """Llama-3.2-1B LoRA at 8 x 1024 on an RTX 3080 was told 1 x 8 alone; bf16 frozen weights
    on 2 x 4 fit 24 % faster (a hunt): the lever goes on the split that fitted and the next
    larger one, as autocast does."""
    from boom_ml.gpus import get_gpu
    from boom_ml.report.levers import half_precision_splits

    step = StepSpec(batch_size=8, seq_len=1024, finetune_method="lora")
    got = {label: s for label, s, _ in half_precision_splits(step, get_gpu("rtx-3080"), 1)}
    assert list(got) == ["amp=bf16 + batch_size=2 x 4 accumulation steps",
                         "amp=bf16 + batch_size=1 x 8 accumulation steps",
                         "params_dtype=bf16 + batch_size=2 x 4 accumulation steps",
                         "params_dtype=bf16 + batch_size=1 x 8 accumulation steps"]  # fmt: skip
    two = got["params_dtype=bf16 + batch_size=2 x 4 accumulation steps"]
    assert (two.params_dtype, two.amp, two.batch_size, two.grad_accum) == ("bf16", "none", 2, 4)


def test_checkpointing_every_beyond_the_blocks_is_one_line(tiny_llama: str) -> None:
    """A hunt: checkpointing.every=100 on 16 blocks ran, printed ckpt=full, and checkpointed
    block 0 alone; K above the block count (2 here) is refused, K equal to it is block 0."""
    from boom_ml.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"checkpointing.every=3 exceeds the model's 2 "):
        trace(tiny_llama, checkpointing="full", checkpointing_every=3)
    graph = trace(tiny_llama, checkpointing="full", checkpointing_every=2)
    assert graph.meta["recipe"]["checkpointed_blocks"] == 1


def test_selective_checkpointing_of_convolution_blocks_says_it_is_full(tmp_path: Path) -> None:
    """A hunt: resnet18 with checkpointing=selective came out byte-identical to full, with no
    word; its blocks hold no matmul or attention, the outputs selective saves. A transformer's
    blocks do, and get no note."""
    note = "checkpointing=selective saves matmul and attention outputs"
    spec = ModelSpec("torchvision:resnet18")
    step = StepSpec(batch_size=2, image_size=32, checkpointing="selective")
    cnn = trace_step(build_model(spec), step)
    assert any(n.startswith(note) for n in cnn.meta["model_notes"])
    full = trace_step(build_model(spec), replace(step, checkpointing="full"))
    assert len(cnn.nodes) == len(full.nodes)
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(TINY_OTHERS["gpt2"]))
    tf = trace(f"hf:{path}", checkpointing="selective")
    assert not any(n.startswith(note) for n in tf.meta["model_notes"])


def test_an_architecture_without_sdpa_says_it_is_traced_eager(tmp_path: Path) -> None:
    """A hunt: gemma-2 asked for attention=sdpa was built eager (transformers has no SDPA path
    for it) with no word, and neither the JSON nor the header named the attention used."""
    path = tmp_path / "gemma2.json"
    path.write_text(json.dumps({
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 100}))  # fmt: skip
    graph = trace(f"hf:{path}")
    assert graph.meta["attention"] == "eager"
    assert (
        "attention=sdpa: transformers' Gemma2ForCausalLM has no sdpa attention; traced with"
        " eager attention, which transformers runs for it by default"
    ) in graph.meta["model_notes"]
    asked = trace(f"hf:{path}", {"attn_implementation": "eager"})
    assert asked.meta["attention"] == "eager"
    assert not any(n.startswith("attention=") for n in asked.meta["model_notes"])


def test_lora_on_a_conv1d_and_a_tied_head_says_nothing_of_peft(tmp_path: Path) -> None:
    """GPT-2's c_attn (Conv1D) with its tied lm_head (nn.Linear) as targets: peft flips
    fan_in_fan_out for each and warns of merging a tied adapter, twice per prediction on the
    user's terminal; neither changes the step. The head still gets its adapter."""
    import warnings

    from boom_ml.zoo.finetune import apply_recipe

    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(TINY_OTHERS["gpt2"]))
    module = build_model(f"hf:{path}").module
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        facts = apply_recipe(
            module, StepSpec(finetune_method="lora", lora_targets=["c_attn", "lm_head"])
        )
    assert [str(w.message)[:60] for w in caught] == []
    assert facts["lora_targets"] == ["c_attn", "lm_head"]
    assert hasattr(module.lm_head, "lora_A")
