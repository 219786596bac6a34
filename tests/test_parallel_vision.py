"""A vision transformer in a multi-GPU layout: its tokens are its patches, and another
image size is built through the config (``boom_ml/parallel/predict.py: _seq_len``)."""

from __future__ import annotations

import pytest


def test_a_vision_transformers_layout_sends_its_patches_not_2048_tokens():
    """ViT-B/16 at 224: 14 x 14 patches and the class token, 197 tokens per image; the layout
    had taken a decoder's 2,048 and sent ten times the bytes between stages (a helper saw
    seq=2048 in the header)."""
    import json

    from boom_ml.predict import run

    out = json.loads(run({"model": "hf:google/vit-base-patch16-224", "gpu": "a100-80gb-sxm",
                          "batch_size": 4, "amp": "bf16", "advice": False, "cache": False,
                          "output": "json", "parallel": {"pp": 2}}))  # fmt: skip
    (entry,) = out["parallel"]
    assert entry["parallel"]["seq_len"] == 197
    sends = [c for c in entry["time"]["collectives"] if c["op"] == "send_recv"]
    # batch x tokens x hidden x 4 bytes (fp32 parameters under autocast: an fp32 residual)
    assert sends and all(c["bytes"] == 4 * 197 * 768 * 4 for c in sends)


def test_a_vits_other_image_size_is_one_line_naming_the_option():
    """image_size=384 on a 224-pixel HF ViT ended in HF's ValueError inside the trace; its
    position table follows the config, so the option to give is model_options.image_size."""
    import json

    from boom_ml.errors import InvalidInputError
    from boom_ml.predict import run

    base = {"model": "hf:google/vit-base-patch16-224", "gpu": "a100-80gb-sxm", "batch_size": 2,
            "advice": False, "cache": False, "max_batch": "off"}  # fmt: skip
    with pytest.raises(InvalidInputError, match="give model_options.image_size=384 to build it"):
        run({**base, "image_size": 384})
    out = json.loads(run({**base, "model_options": {"image_size": 384}, "output": "json",
                          "parallel": {"dp": 2}}))  # fmt: skip
    assert out["parallel"][0]["parallel"]["seq_len"] == 24 * 24 + 1


def test_a_vits_layout_says_the_tokens_it_took_and_a_band_around_its_estimate():
    """seq_len=512 on ViT-B/16 at 224: the layout sends 197 tokens, and its header and JSON
    step say 197 (they had said 512). Its worst rank's p10-p90 holds the estimate: the 1- and
    2-layer traces' bands, extrapolated to 12 layers, had crossed (2.7 GiB, p90 2.5)."""
    import json

    from boom_ml.predict import run

    out = json.loads(run({"model": "hf:google/vit-base-patch16-224", "gpu": "a100-80gb-sxm",
                          "batch_size": 8, "seq_len": 512, "advice": False, "cache": False,
                          "output": "json", "parallel": {"dp": 2}}))  # fmt: skip
    assert out["step"]["seq_len"] == 197
    memory = out["parallel"][0]["memory"]
    assert memory["p10_bytes"] <= memory["total_bytes"] <= memory["p90_bytes"]
