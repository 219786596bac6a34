"""The lines under a multi-GPU layout's table: its collectives, the links they were timed on,
and a LoRA/QLoRA layout's recipe."""

from __future__ import annotations

from typing import Any

from boom_ml.estimates import Prediction


def layout_recipe_line(prediction: Prediction) -> str:
    """LoRA / QLoRA in a layout: its adapters and what the worst rank trains ('' for full)."""
    step = prediction.step
    if step.get("finetune_method", "full") == "full":
        return ""
    mem = prediction.parallel[0].get("memory") or {}
    recipe = prediction.parallel[0].get("recipe") or {}
    targets = ",".join(step.get("lora_targets") or recipe.get("lora_targets") or []) or (
        "peft's defaults for the model"
    )
    if recipe.get("adapter_dtypes"):
        targets += f", in {'/'.join(recipe['adapter_dtypes'])}"
    trained = (f"; the worst rank trains {mem['trainable_parameters'] / 1e6:.1f} M of its"
               f" {mem['parameters'] / 1e6:.1f} M parameters" if "trainable_parameters" in mem
               else "")  # fmt: skip
    return (f"Recipe: {step['finetune_method']} adapters r={step['lora_r']}, alpha="
            f"{step['lora_alpha']:g}, targets {targets}{trained}.")  # fmt: skip


def links_text(time: dict[str, Any]) -> str:
    """ ", over pcie4 (ring busbw 25.2 GB/s)": the links the collectives were timed on."""
    links = time.get("links") or {}
    parts = [f"{links[k]} (ring busbw {links[f'{k}_busbw_gbs']:g} GB/s) {where}"
             for k, where in (("intra", "within a node"), ("inter", "between nodes"))
             if k in links]  # fmt: skip
    return f", over {' and '.join(parts)}" if parts else ""


def collective_lines(prediction: Prediction, top_n: int = 5) -> list[str]:
    lines = []
    for g in prediction.parallel:
        colls = sorted(g["time"].get("collectives", []), key=lambda c: -c.get("exposed_ms", 0))
        lines.append(f"{g['gpu']}: {g['time'].get('method', '')}")
        lines.append(f"{g['gpu']}: top collectives (exposed ms){links_text(g['time'])}:")
        width = max([len(c.get("what", "")) for c in colls[:top_n]] + [28])
        lines += [
            f"    {c['op']:<15} {c['group']:<4} {c.get('what', ''):<{width}} "
            f"{c['bytes'] / 2**20:>10.1f} MiB x{c.get('calls', 1):<4} {c['ms']:>9.2f} ms "
            f"(exposed {c.get('exposed_ms', 0):.2f})"
            for c in colls[:top_n]
        ]
        if g["time"].get("accumulate_ms"):
            lines.append(
                f"    {_later(g['parallel']['microbatches'])} into the kept"
                f" gradients: {g['time']['accumulate_ms']:.2f} ms of the step on the critical"
                " rank (none with parallel.grad_accumulation=fused, Megatron-LM's fusion)"
            )
    return lines


def _later(microbatches: int) -> str:
    """The micro-batches after the first, as the sentence's subject ("micro-batch 2 adds")."""
    return "micro-batch 2 adds" if microbatches == 2 else f"micro-batches 2..{microbatches} add"
