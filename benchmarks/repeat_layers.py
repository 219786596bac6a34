"""Which shipped hf: configs trace with one layer repeated, and whether that equals the whole trace.

Run: python benchmarks/repeat_layers.py [--layers 12] [--cases 0,3,12]

Each case builds a shipped config with ``--layers`` layers, traces it shallow and repeated
(``boom_ml.trace.repeat.trace_repeated``) and whole (``trace_step``), and prints one row: the
verdict (``equal``; ``whole (config)`` where the config sets layers apart; ``whole`` with
the reason where the step names layers or the 4-layer check failed; ``DIFFERENT`` with
where, which would be a bug), and the seconds of each way (wall clock, this machine, this process; the first case
pays the imports).
"""

from __future__ import annotations

import argparse
import logging
import time

LLAMA = "hf:meta-llama/Llama-3.2-1B"
SMALL = {"batch_size": 2, "seq_len": 64}
CASES: list[tuple[str, dict, dict]] = [
    (LLAMA, {}, SMALL),
    (LLAMA, {}, {**SMALL, "amp": "fp16"}),
    (LLAMA, {}, {**SMALL, "amp": "bf16", "finetune_method": "lora", "params_dtype": "bf16"}),
    (
        LLAMA,
        {},
        {**SMALL, "amp": "bf16", "finetune_method": "qlora", "optimizer": "paged-adamw8bit"},
    ),  # fmt: skip
    (LLAMA, {}, {**SMALL, "checkpointing": "selective", "zero_grad": "zero"}),
    (LLAMA, {}, {**SMALL, "amp": "bf16", "finetune_method": "qlora", "checkpointing": "full"}),
    (LLAMA, {}, {**SMALL, "optimizer": "adafactor"}),
    (LLAMA, {}, {**SMALL, "optimizer": "adamw8bit", "params_dtype": "bf16"}),
    (LLAMA, {}, {**SMALL, "params_dtype": "fp16", "master_weights": True}),
    (LLAMA, {}, {**SMALL, "optimizer": "none"}),
    (LLAMA, {}, {**SMALL, "optimizer": "sgd-momentum", "optimizer_impl": "loop"}),
    (LLAMA, {"attn_implementation": "eager"}, {**SMALL, "amp": "bf16", "sdpa_group": "sm70"}),
    ("hf:gpt2", {}, {**SMALL, "amp": "bf16"}),
    (
        "hf:mistralai/Mixtral-8x7B-v0.1",
        {},
        {"batch_size": 1, "seq_len": 32, "amp": "bf16", "finetune_method": "lora"},
    ),  # fmt: skip
    (
        "hf:mistralai/Mixtral-8x7B-v0.1",
        {},
        {"batch_size": 1, "seq_len": 32, "amp": "bf16", "finetune_method": "qlora"},
    ),  # fmt: skip
    ("hf:Qwen/Qwen2.5-0.5B", {}, {**SMALL, "amp": "bf16", "checkpointing": "full"}),
    ("hf:Qwen/Qwen3-30B-A3B", {}, {"batch_size": 1, "seq_len": 32, "amp": "bf16"}),
    (
        "hf:Qwen/Qwen1.5-MoE-A2.7B",
        {},
        {"batch_size": 1, "seq_len": 32, "amp": "bf16", "checkpointing": "full"},
    ),  # fmt: skip
    ("hf:microsoft/Phi-3-mini-4k-instruct", {}, {"batch_size": 1, "seq_len": 64, "amp": "bf16"}),
    ("hf:google/gemma-2-2b", {}, {"batch_size": 1, "seq_len": 64, "amp": "bf16"}),
    ("hf:google/gemma-3-1b-pt", {}, {"batch_size": 1, "seq_len": 64, "amp": "bf16"}),
    ("hf:bert-base-uncased", {}, {**SMALL, "amp": "fp16"}),
    ("hf:tiiuae/falcon-7b", {}, {"batch_size": 1, "seq_len": 64, "amp": "bf16"}),
    ("hf:facebook/opt-125m", {}, SMALL),
    ("hf:allenai/OLMo-2-1124-7B", {}, {"batch_size": 1, "seq_len": 64, "amp": "bf16"}),
    ("hf:deepseek-ai/DeepSeek-V2-Lite", {}, {"batch_size": 1, "seq_len": 32, "amp": "bf16"}),
    ("hf:google/vit-base-patch16-224", {}, {"batch_size": 2, "amp": "bf16"}),
]
LAYER_KEYS = {"hf:gpt2": "n_layer"}


class _Reasons(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.last = record.getMessage().partition(" whole: ")[2]


def run_case(model: str, options: dict, step: dict, layers: int, reasons: _Reasons) -> list[str]:
    from boom_ml.specs import ModelSpec, StepSpec
    from boom_ml.trace.repeat import shallow_options, trace_repeated
    from boom_ml.trace.step import trace_step
    from boom_ml.trace.stretch import difference
    from boom_ml.zoo import build_model

    key = LAYER_KEYS.get(model, "num_hidden_layers")
    spec = ModelSpec(model, {**options, key: layers})
    recipe = StepSpec(**step)
    label = " ".join(f"{k}={v}" for k, v in {**options, **step}.items())
    started = time.perf_counter()
    reasons.last = ""
    repeated = trace_repeated(spec, recipe)
    shallow_s = time.perf_counter() - started
    started = time.perf_counter()
    whole = trace_step(build_model(spec), recipe)
    whole_s = time.perf_counter() - started
    if repeated is None:
        verdict = "whole (config)" if shallow_options(spec) is None else "whole"
        why = reasons.last
    else:
        why = difference(repeated, whole) or ""
        meta = [k for k in whole.meta if k != "trace_seconds" and repeated.meta.get(k) != whole.meta[k]]  # fmt: skip
        verdict = "equal" if not why and not meta else "DIFFERENT"
        why = why or ", ".join(meta)
    return [model, label, verdict, f"{shallow_s:.2f}", f"{whole_s:.2f}", why[:80]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="layers of each model (>= 10)")
    parser.add_argument("--cases", default="", help="comma-separated case numbers (default: all)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    reasons = _Reasons()
    logging.getLogger("boom_ml.trace.repeat").addHandler(reasons)
    logging.getLogger("boom_ml.trace.repeat").setLevel(logging.INFO)
    chosen = {int(c) for c in args.cases.split(",") if c.strip()}
    table = Table(title=f"one layer repeated against the whole trace, {args.layers} layers")
    for column in ("#", "model", "options", "verdict", "repeated s", "whole s", "why"):
        table.add_column(column)
    for i, (model, options, step) in enumerate(CASES):
        if chosen and i not in chosen:
            continue
        table.add_row(str(i), *run_case(model, options, step, args.layers, reasons))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
