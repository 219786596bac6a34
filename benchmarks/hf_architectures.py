"""Which Hugging Face architectures trace: one tiny config per model type, built offline.

Run: python benchmarks/hf_architectures.py [--types llama,bert ...] [--heads]

Each type's config comes from ``transformers.AutoConfig.for_model`` (no network) shrunk to 2
layers, width 64, 4 heads (2 KV heads), FFN 128, vocabulary 1,000, with its causal-LM,
seq2seq, masked-LM, image-classification or CTC head; each is predicted once on an
A100-80GB at batch 2 (64 tokens or 32-pixel images, no advice, no max-batch search, no
cache) in this process. ``--heads`` also tries other task heads of a few types. Prints one
row per type: ``ok`` or the one-line error, and seconds (wall clock, this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DECODERS = ("llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi "
            "phi3 falcon gpt_neox gptj gpt_bigcode bloom opt mpt olmo olmo2 starcoder2 cohere "
            "stablelm granite nemotron deepseek_v3 mamba mamba2 jamba recurrent_gemma rwkv gpt2 "
            "codegen xglm persimmon phimoe granitemoe olmoe glm glm4 helium falcon_mamba bamba "
            "exaone4 ministral smollm3 seed_oss").split()  # fmt: skip
SEQ2SEQ = ("t5 bart mbart pegasus marian whisper mt5 longt5 switch_transformers led m2m_100 "
           "nllb-moe blenderbot plbart speech_to_text").split()  # fmt: skip
ENCODERS = ("bert roberta deberta-v2 electra distilbert albert xlm-roberta longformer big_bird "
            "funnel mobilebert camembert mpnet ernie roformer modernbert").split()  # fmt: skip
VISION = ("vit deit swin convnext beit clip_vision_model siglip_vision_model dinov2 mobilevit "
          "efficientnet resnet regnet poolformer data2vec-vision").split()  # fmt: skip
AUDIO = ("wav2vec2", "hubert")
HEADS = {
    "llama": ["LlamaForSequenceClassification", "LlamaForTokenClassification",
              "LlamaForQuestionAnswering"],
    "bert": ["BertForSequenceClassification", "BertForTokenClassification",
             "BertForQuestionAnswering", "BertForMultipleChoice", "BertForPreTraining",
             "BertForNextSentencePrediction"],
    "deberta-v2": ["DebertaV2ForSequenceClassification"],
    "t5": ["T5ForSequenceClassification", "T5EncoderModel"],
    "bart": ["BartForSequenceClassification"],
    "vit": ["ViTModel"],
}  # fmt: skip
SMALL = {"num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "encoder_layers": 2,
         "decoder_layers": 2, "num_decoder_layers": 2, "hidden_size": 64, "n_embd": 64,
         "d_model": 64, "dim": 64, "num_attention_heads": 4, "n_head": 4, "n_heads": 4,
         "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "d_ff": 128, "ffn_dim": 128, "encoder_ffn_dim": 128,
         "decoder_ffn_dim": 128, "hidden_dim": 128, "n_inner": 128, "vocab_size": 1000,
         "head_dim": 16, "d_kv": 16, "num_experts": 4, "num_local_experts": 4,
         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 64, "n_group": 1, "topk_group": 1,
         "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
         "v_head_dim": 16, "embedding_size": 32, "image_size": 32, "patch_size": 4,
         "max_position_embeddings": 512, "n_positions": 512}  # fmt: skip
# per type: what its config needs beyond SMALL to be small and valid (None: drop the key)
EXTRA = {
    "swin": {"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4},
    "convnext": {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2},
    "mamba2": {"num_heads": 4, "head_dim": 32, "expand": 2, "n_groups": 1, "state_size": 16},
    "mamba": {"state_size": 16},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "mamba_d_state": 8},
    "recurrent_gemma": {"lru_width": 64, "attention_window_size": 32,
                        "block_types": ["recurrent", "attention"]},
    "rwkv": {"attention_hidden_size": 64, "context_length": 512},
    "longformer": {"attention_window": 16},
    "gemma3_text": {"sliding_window": 32},
    "mistral": {"sliding_window": 32},
    "phi3": {"original_max_position_embeddings": 512},
    # published DeepSeek configs have no head_dim (MLA derives it) and as many KV heads as heads
    "deepseek_v3": {"first_k_dense_replace": 1, "head_dim": None, "num_key_value_heads": 4},
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "efficientnet": {"hidden_dim": None},
    "whisper": {"num_mel_bins": 16, "max_source_positions": 64, "max_target_positions": 64},
    "wav2vec2": {"conv_dim": [16, 16], "conv_kernel": [10, 3], "conv_stride": [5, 2],
                 "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4},
}  # fmt: skip


def _head(model_type: str) -> str | None:
    from transformers.models.auto import modeling_auto as auto

    def first(mapping: dict) -> str | None:
        value = mapping.get(model_type)
        return value if isinstance(value, str) else (value[0] if value else None)

    if model_type in SEQ2SEQ:
        return first(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES) or first(
            auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
        )
    if model_type in VISION:
        return first(auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES) or first(
            auto.MODEL_MAPPING_NAMES
        )
    if model_type in ENCODERS:
        return first(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    if model_type in AUDIO:
        return first(auto.MODEL_FOR_CTC_MAPPING_NAMES)
    return first(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, head: str | None = None) -> dict:
    """The type's default config shrunk (SMALL, EXTRA), with ``head`` as its architecture."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    kw = {k: v for k, v in SMALL.items() if k in defaults}
    kw.update(EXTRA.get(model_type, {}))
    raw = AutoConfig.for_model(model_type, **{k: v for k, v in kw.items() if v is not None})
    raw = raw.to_dict()
    for k, v in kw.items():
        if v is None:
            raw.pop(k, None)
    raw["architectures"] = [head or _head(model_type)]
    vocab = raw.get("vocab_size")
    for k, v in list(raw.items()):  # special token ids of the full vocabulary: into the tiny one
        if k.endswith("token_id") and vocab and isinstance(v, int) and v >= vocab:
            raw[k] = 1
        elif k.endswith("token_id") and vocab and isinstance(v, list):
            raw[k] = [x if x < vocab else 1 for x in v]
    return raw


def run(model_type: str, head: str | None, folder: Path) -> tuple[str, float]:
    """``ok`` or the one-line error of predicting the tiny model, and the seconds it took."""
    import boom_ml
    from boom_ml.errors import BoomError

    started = time.perf_counter()
    try:
        path = folder / (head or model_type) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(tiny_config(model_type, head), default=str))
        size = {"image_size": 32} if model_type in VISION else {"seq_len": 64}
        boom_ml.predict(model=f"hf:{path}", gpu="a100-80gb-pcie", batch_size=2, advice=False,
                        max_batch="off", cache=False, **size)  # fmt: skip
        result = "ok"
    except BoomError as err:
        result = f"error: {err}"
    except Exception as err:  # noqa: BLE001 - a config transformers itself rejects, or a bug
        result = f"FAILED ({type(err).__name__}): {' '.join(str(err).split())[:160]}"
    return result, time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--types", help="comma-separated model types (default: all listed)")
    ap.add_argument("--heads", action="store_true", help="also other task heads of a few types")
    args = ap.parse_args(argv)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    listed = DECODERS + SEQ2SEQ + ENCODERS + VISION + list(AUDIO)
    types = args.types.split(",") if args.types else listed
    jobs = [(t, None) for t in types if t in CONFIG_MAPPING_NAMES]
    if args.heads:
        jobs += [(t, h) for t, heads in HEADS.items() for h in heads]
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type, head in jobs:
            result, seconds = run(model_type, head, Path(tmp))
            kind = result.split(" ", 1)[0].rstrip(":")
            counts[kind] = counts.get(kind, 0) + 1
            print(f"{head or model_type:40s} {seconds:5.1f} s  {result}", flush=True)
    absent = [t for t in types if t not in CONFIG_MAPPING_NAMES]
    print(f"{len(jobs)} tried: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
          + (f"; not in this transformers: {', '.join(absent)}" if absent else ""))  # fmt: skip


if __name__ == "__main__":
    main()
