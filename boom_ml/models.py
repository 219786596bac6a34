"""``python -m boom_ml.models``: the model zoo — shipped HF configs and the other schemes.

Listing the shipped Hugging Face configs reads their JSON only (no torch import, well under
a second); parameter counts come from the config by formula for the decoder families whose
layout is known (``config_params``: Llama-like decoders, GPT-2, GPT-Neo, OPT, BERT, T5, ViT,
Falcon, DeepSeek-V2), else are left blank. ``--scheme torchvision`` /
``--scheme timm`` import those libraries to list their names.

    python -m boom_ml.models                     # shipped hf: configs + how to name others
    python -m boom_ml.models --scheme timm       # every timm name (imports timm)
    python -m boom_ml.models --json              # the hf table as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from boom_ml.hf_shipped import shipped

SCHEMES = ("hf", "torchvision", "timm", "file")

# Decoder families laid out as Llama (embedding, N x [attention, gated MLP or MoE, norms],
# final norm, LM head): per family, the norms per layer and the q/k norm layout.
_LLAMA_LIKE = {
    # model_type: (norm vectors of width hidden per layer, q/k norm: None | "head" | "full")
    "llama": (2, None),
    "mistral": (2, None),
    "mixtral": (2, None),
    "qwen2": (2, None),
    "qwen2_moe": (2, None),
    "qwen3": (2, "head"),
    "qwen3_moe": (2, "head"),
    "phi3": (2, None),
    "olmo2": (2, "full"),
    "gemma2": (4, None),
    "gemma3_text": (4, "head"),
}


def _moe_layer(raw: dict[str, Any], layer: int) -> bool:
    if raw["model_type"] == "mixtral":
        return True
    if layer in (raw.get("mlp_only_layers") or []):
        return False
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    return int(raw.get("num_experts", 0) or 0) > 0 and (layer + 1) % step == 0


def config_params(raw: dict[str, Any]) -> int | None:
    """Parameters of the model a config builds, by formula; None for unknown layouts.

    Exact for the families in ``_LLAMA_LIKE`` and ``_OTHER`` (tests compare it with a meta
    build of every shipped config it answers for).
    """
    kind = raw.get("model_type")
    if kind in _OTHER:
        return _OTHER[kind](raw)
    if kind not in _LLAMA_LIKE:
        return None
    norms, qk_norm = _LLAMA_LIKE[kind]
    h, vocab, layers = raw["hidden_size"], raw["vocab_size"], raw["num_hidden_layers"]
    heads = raw["num_attention_heads"]
    kv = raw.get("num_key_value_heads") or heads
    hd = raw.get("head_dim") or h // heads
    # Gemma always ties; these families' config classes default to untied
    tied = True if kind.startswith("gemma") else raw.get("tie_word_embeddings", False)
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if kind in ("qwen2", "qwen2_moe"):  # q, k, v biases
        attn += heads * hd + 2 * kv * hd
    elif raw.get("attention_bias"):
        attn += heads * hd + 2 * kv * hd + h
    if qk_norm == "head":
        attn += 2 * hd
    elif qk_norm == "full":
        attn += heads * hd + kv * hd
    inter = raw["intermediate_size"]
    dense_mlp = 3 * h * inter + (2 * inter + h if raw.get("mlp_bias") else 0)
    total = vocab * h * (1 if tied else 2) + h  # embeddings (+ head) and the final norm
    for layer in range(layers):
        total += attn + norms * h
        if kind == "mixtral":
            experts = raw["num_local_experts"]
            total += experts * h + experts * 3 * h * inter
        elif kind.endswith("_moe") and _moe_layer(raw, layer):
            experts, moe_inter = raw["num_experts"], raw["moe_intermediate_size"]
            total += experts * h + experts * 3 * h * moe_inter
            shared = raw.get("shared_expert_intermediate_size") or 0
            if shared:  # Qwen2-MoE's always-on expert and its sigmoid gate
                total += 3 * h * shared + h
        else:
            total += dense_mlp
    return total


def _gpt2(raw: dict[str, Any]) -> int:
    """GPT-2: learned positions, Conv1D layers with biases, LayerNorms, tied head."""
    h, inner = raw["n_embd"], raw.get("n_inner") or 4 * raw["n_embd"]
    block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    return (raw["vocab_size"] + raw["n_positions"]) * h + raw["n_layer"] * block + 2 * h


def _gpt_neo(raw: dict[str, Any]) -> int:
    """GPT-Neo: GPT-2's layout with bias-free q, k, v projections."""
    h = raw["hidden_size"]
    inner = raw.get("intermediate_size") or 4 * h
    block = 4 * h + 3 * h * h + (h * h + h) + (h * inner + inner) + (inner * h + h)
    return (
        (raw["vocab_size"] + raw["max_position_embeddings"]) * h + raw["num_layers"] * block + 2 * h
    )


def _opt(raw: dict[str, Any]) -> int:
    """OPT: positions offset by 2, projections in and out when the embedding is narrower,
    a final LayerNorm with pre-norm layers, tied head."""
    h, ffn = raw["hidden_size"], raw["ffn_dim"]
    proj = raw.get("word_embed_proj_dim") or h
    bias = raw.get("enable_bias", True)
    block = 4 * (h * h + h * bias) + 2 * h + (h * ffn + ffn * bias) + (ffn * h + h * bias) + 2 * h
    total = raw["vocab_size"] * proj + (raw["max_position_embeddings"] + 2) * h
    total += 2 * proj * h if proj != h else 0
    if raw.get("do_layer_norm_before", True) and not raw.get("_remove_final_layer_norm", False):
        total += 2 * h
    return total + raw["num_hidden_layers"] * block


def _bert(raw: dict[str, Any]) -> int:
    """BertForMaskedLM: embeddings (words, positions, token types, LayerNorm), no pooler,
    the prediction head's transform and bias (its decoder weight is the word embedding)."""
    h, inner, vocab = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    embed = (vocab + raw["max_position_embeddings"] + raw.get("type_vocab_size", 2)) * h + 2 * h
    block = 4 * (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h) + 2 * h
    return embed + raw["num_hidden_layers"] * block + (h * h + h) + 2 * h + vocab


def _t5(raw: dict[str, Any]) -> int:
    """T5ForConditionalGeneration: shared embedding, bias-free attention and feed-forward
    (gated: two input projections), RMS norms, relative position buckets in each stack's
    first layer; the head is the shared embedding (transformers 5's T5Config ties it
    whatever the config says: flan-t5's ``tie_word_embeddings: false`` now only turns off
    the decoder's output scaling)."""
    d, ff, vocab = raw["d_model"], raw["d_ff"], raw["vocab_size"]
    inner, heads = raw["num_heads"] * raw["d_kv"], raw["num_heads"]
    buckets = raw.get("relative_attention_num_buckets", 32)
    gated = str(raw.get("feed_forward_proj", "relu")).startswith("gated")
    attn, mlp = 4 * d * inner + d, (3 if gated else 2) * d * ff + d
    enc, dec = raw["num_layers"], raw.get("num_decoder_layers") or raw["num_layers"]
    stacks = enc * (attn + mlp) + dec * (2 * attn + mlp) + 2 * (buckets * heads + d)
    return vocab * d + stacks


def _vit(raw: dict[str, Any]) -> int:
    """ViTForImageClassification: a patch convolution, the class token and a position per
    patch, pre-norm blocks with biased projections, a final LayerNorm, no pooler, and the
    classifier over ``num_labels`` (or the labels the config names)."""
    h, inner = raw["hidden_size"], raw["intermediate_size"]
    patch, channels = raw.get("patch_size", 16), raw.get("num_channels", 3)
    size = raw.get("image_size", 224)
    labels = len(raw.get("id2label") or {}) or raw.get("num_labels", 2)
    qkv = 3 * (h * h + h * raw.get("qkv_bias", True))
    block = 4 * h + qkv + (h * h + h) + (h * inner + inner) + (inner * h + h)
    embed = channels * patch * patch * h + h + h + ((size // patch) ** 2 + 1) * h
    return embed + raw["num_hidden_layers"] * block + 2 * h + h * labels + labels


def _falcon(raw: dict[str, Any]) -> int:
    """FalconForCausalLM: fused q/k/v over ``num_kv_heads`` (one under ``multi_query``),
    a 4x MLP, LayerNorms (one per block when attention and MLP run in parallel on the old
    layout, two on the new one), tied head."""
    h, heads, bias = raw["hidden_size"], raw["num_attention_heads"], raw.get("bias", False)
    hd = h // heads
    new = raw.get("new_decoder_architecture", False)
    if new:
        kv = raw.get("num_kv_heads") or heads
    else:
        kv = 1 if raw.get("multi_query", True) else heads
    inner = raw.get("ffn_hidden_size") or 4 * h
    qkv = h * (heads + 2 * kv) * hd + bias * (heads + 2 * kv) * hd
    dense, mlp = h * h + bias * h, 2 * h * inner + bias * (inner + h)
    # FalconDecoderLayer: two norms unless attention and MLP run in parallel on one
    # (num_ln_in_parallel_attn, 2 by default on the new layout: Falcon-11B sets 1)
    parallel_norms = raw.get("num_ln_in_parallel_attn") or (2 if new else 1)
    norms = 2 if not raw.get("parallel_attn", True) or parallel_norms == 2 else 1
    tied = raw.get("tie_word_embeddings", True)
    total = raw["vocab_size"] * h * (1 if tied else 2) + 2 * h
    return total + raw["num_hidden_layers"] * (qkv + dense + mlp + 2 * h * norms)


def _deepseek_v2(raw: dict[str, Any]) -> int:
    """DeepseekV2ForCausalLM: multi-head latent attention (queries through an optional
    low-rank ``q_lora_rank``, keys and values through ``kv_lora_rank`` with a decoupled
    rotary key), dense MLPs in the first ``first_k_dense_replace`` layers, then routed and
    shared experts every ``moe_layer_freq`` layers; RMS norms, untied head."""
    h, heads, vocab = raw["hidden_size"], raw["num_attention_heads"], raw["vocab_size"]
    nope, rope, v = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
    kv_rank, q_rank = raw["kv_lora_rank"], raw.get("q_lora_rank")
    q_out = heads * (nope + rope)
    query = h * q_out if not q_rank else h * q_rank + q_rank + q_rank * q_out
    attn = query + h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v) + heads * v * h
    dense = 3 * h * raw["intermediate_size"]
    experts, moe_inter = raw["n_routed_experts"], raw["moe_intermediate_size"]
    sparse = experts * h + (experts + raw.get("n_shared_experts", 0)) * 3 * h * moe_inter
    freq, first = raw.get("moe_layer_freq", 1), raw.get("first_k_dense_replace", 0)
    tied = raw.get("tie_word_embeddings", False)
    total = vocab * h * (1 if tied else 2) + h
    for layer in range(raw["num_hidden_layers"]):
        moe = layer >= first and layer % freq == 0
        total += attn + 2 * h + (sparse if moe else dense)
    return total


_OTHER = {"gpt2": _gpt2, "gpt_neo": _gpt_neo, "opt": _opt, "bert": _bert, "t5": _t5,
          "vit": _vit, "falcon": _falcon, "deepseek_v2": _deepseek_v2}  # fmt: skip


def _human(n: int | None) -> str:
    if n is None:
        return ""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def shipped_rows() -> list[dict[str, Any]]:
    """One row per shipped HF config: id, architecture, model type, params, source."""
    rows = []
    for model_id, path in shipped().items():
        raw = json.loads(path.read_text())
        rows.append(
            {
                "id": f"hf:{model_id}",
                "architecture": (raw.get("architectures") or [""])[0],
                "model_type": raw.get("model_type", ""),
                "params": config_params(raw),
                "moe": bool(
                    raw.get("num_local_experts")
                    or raw.get("num_experts")
                    or raw.get("n_routed_experts")
                ),
                "source": raw.get("_source") or f"https://huggingface.co/{model_id}",
            }
        )
    return rows


def _print_hf(rows: list[dict[str, Any]]) -> None:
    print(f"Hugging Face configs shipped with boom-ml ({len(rows)}; hf:<id>, built on meta):")
    width = max(len(r["id"]) for r in rows)
    arch_width = max(len(r["architecture"]) for r in rows)
    print(f"  {'id':<{width}}  {'architecture':<{arch_width}}  {'params':>8}  source")
    for r in rows:
        kind = r["architecture"] + (" (MoE)" if r["moe"] else "")
        source = r["source"].split(";")[0]
        print(f"  {r['id']:<{width}}  {kind:<{arch_width}}  {_human(r['params']):>8}  {source}")
    print(
        "  Any other hub id works too: hf:<org>/<name> reads config.json from the local "
        "Hugging Face cache\n  (HF_HOME / HF_HUB_CACHE), else downloads config.json alone "
        "(never weights) unless HF_HUB_OFFLINE=1;\n  hf:<org>/<name>@<revision> pins a branch, "
        "tag or commit; hf:<path> takes a local config.json or a folder holding one."
    )


def _print_others() -> None:
    print("Other schemes:")
    print("  torchvision:<name>        torchvision classifiers, segmentation, video")
    print("                            (python -m boom_ml.models --scheme torchvision)")
    print("  timm:<name>               any timm model (python -m boom_ml.models --scheme timm)")
    print("  file:<path.py>:<factory>  your own nn.Module factory, e.g. file:my_model.py:make")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m boom_ml.models", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--scheme", choices=SCHEMES, help="list one scheme's names only")
    parser.add_argument("--json", action="store_true", help="JSON instead of a table")
    args = parser.parse_args(argv)
    if args.scheme in (None, "hf"):
        rows = shipped_rows()
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        _print_hf(rows)
        if args.scheme is None:
            print()
            _print_others()
        return 0
    if args.scheme == "file":
        print(
            "[]"  # a JSON reader gets an empty list, as for any scheme with nothing to name
            if args.json
            else "file:<path.py>:<factory> builds whatever nn.Module your factory returns; "
            "nothing to list."
        )
        return 0
    from boom_ml.zoo import list_models  # imports torch (and timm / torchvision)

    names = list_models(args.scheme)
    print(json.dumps(names, indent=1) if args.json else "\n".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
