"""Memory and time of one model's fine-tuning recipes on one GPU (issue #15's README table).

    python benchmarks/recipes_table.py                       # Llama-3.2-1B on an A100 80GB SXM
    python benchmarks/recipes_table.py --model hf:meta-llama/Meta-Llama-3-8B --batch 2 --checkpointing full

Rows: full fine-tuning, LoRA (peft's default targets, r=8) and QLoRA (NF4 base weights),
each with AMP (bf16 autocast over fp32 parameters) and bf16-true (bf16 parameters, no
autocast), and full fine-tuning with bf16 parameters and fp32 master weights, AdamW (``--optimizer``), no checkpointing (``--checkpointing``). Predictions
only: nothing here is a measurement.
"""

from __future__ import annotations

import argparse
import time

import boom_ml

GIB = 2**30
RECIPES = [
    ("full", "AMP bf16 (fp32 params)", {"amp": "bf16"}),
    ("full", "bf16-true", {"params_dtype": "bf16"}),
    ("full", "bf16 + fp32 master", {"params_dtype": "bf16", "master_weights": True}),
    ("lora", "AMP bf16 (fp32 params)", {"amp": "bf16", "finetune": {"method": "lora"}}),
    ("lora", "bf16-true", {"params_dtype": "bf16", "finetune": {"method": "lora"}}),
    ("qlora", "AMP bf16 (fp32 params)", {"amp": "bf16", "finetune": {"method": "qlora"}}),
    ("qlora", "bf16-true", {"params_dtype": "bf16", "finetune": {"method": "qlora"}}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hf:meta-llama/Llama-3.2-1B")
    parser.add_argument("--gpu", default="a100-80gb-sxm")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--checkpointing", default="none", help="none | full | selective")
    args = parser.parse_args()
    print(
        f"{args.model} on {args.gpu}, batch {args.batch} x {args.seq} tokens, {args.optimizer}, "
        f"checkpointing={args.checkpointing}"
    )
    print(
        "| method | precision | trainable params | peak GiB (nvidia-smi, p50) | step ms | time method | fits |"
    )
    print("|---|---|---|---|---|---|---|")
    for method, precision, options in RECIPES:
        started = time.perf_counter()
        result = boom_ml.predict(
            model=args.model,
            gpu=args.gpu,
            batch_size=args.batch,
            seq_len=args.seq,
            optimizer=args.optimizer,
            checkpointing=args.checkpointing,
            advice=False,
            **options,
        )
        gpu = result.gpus[0]
        trainable = result.graph.get("num_trainable_parameters") or 0
        print(
            f"| {method} | {precision} | {trainable / 1e6:,.1f} M "
            f"| {gpu.memory.total_bytes / GIB:.1f} | {gpu.time.step_ms:,.0f} "
            f"| {gpu.time.method.split(' (')[0]} | {gpu.memory.fit} |"
            f"  <!-- {time.perf_counter() - started:.0f} s -->"
        )


if __name__ == "__main__":
    main()
