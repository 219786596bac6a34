"""The advisor's answers as terminal lines: changes that make a step fit on one GPU, the
recipes apart, and the multi-GPU layouts the layout search found (``table.py`` prints them)."""

from __future__ import annotations

from typing import Any

from boom_ml.estimates import Prediction, rate_text
from boom_ml.report.advisor import Advice, is_adapters, is_bf16_true, nothing_fits
from boom_ml.report.explain import GIB
from boom_ml.report.levers import BF16_TRUE
from boom_ml.specs import MAX_BATCH_AUTO_GPUS
from boom_ml.timing.basis import UNMEASURED, half_text


def advice_lines(prediction: Prediction) -> list[str]:
    lines: list[str] = []
    for gpu, all_items in prediction.advice.items():
        items = [a for a in all_items if not a.recipe]
        recipes = [a for a in all_items if a.recipe]
        if not items:
            lines.append(f"{gpu}: no change tried makes it fit")
        elif not items[0].fits:
            a = items[0]
            found = prediction.layout_advice.get(gpu, {})
            # the layouts say more; so does the reason none was searched (a torchvision model:
            # the hint had proposed FSDP a line above "parallel layouts support hf: models")
            said = found.get("layouts") or found.get("closest") or found.get("reason")
            hint = "" if said else " (consider sharding the model over GPUs, e.g. FSDP/ZeRO)"
            need = f"{_with_p90(a)} of {a.capacity_bytes / GIB:.1f} GiB{hint}"
            lines.append(
                f"{gpu}: no single-GPU change that keeps the weights' dtype fits: parameters"
                f" and gradients alone need {need}"
                if a.lower_bound
                else f"{gpu}: nothing tried fits on one GPU; closest: {a.change} needs {need}"
            )
            lines += layout_lines(found)
        else:
            lines.append(f"{gpu}: to fit, change")
            lines += [_advice_line(a) for a in items]
        true16 = [a for a in recipes if is_bf16_true(a)]
        adapters = [a for a in recipes if is_adapters(a)]
        if true16:
            lines.append(f"    or train every weight in bf16 ({BF16_TRUE}):")
            lines += ["  " + _advice_line(a) for a in true16]
        if adapters and prediction.step.get("finetune_method", "full") == "full":
            lines.append("    or fine-tune adapters instead of training every weight:")
            lines += ["  " + _advice_line(a) for a in adapters]
        elif adapters:  # LoRA that does not fit: its base weights in 4 bits
            lines.append("    or quantise the frozen base weights to 4 bits:")
            lines += ["  " + _advice_line(a) for a in adapters]
        lines += _half_advice_line(prediction, gpu, [a for a in all_items if a.fits])
    stuck = [g for g, items in prediction.advice.items() if nothing_fits(items)]
    if (
        stuck
        and len(prediction.gpus) > MAX_BATCH_AUTO_GPUS
        and prediction.step.get("finetune_method", "full") == "full"
    ):
        lines.append(
            f"Recipes (bf16-true, LoRA, QLoRA) were not tried for {len(prediction.gpus)} GPUs; "
            f"ask at most {MAX_BATCH_AUTO_GPUS} to see which fit where nothing else does."
        )
    return lines


def _half_advice_line(prediction: Prediction, gpu: str, fits: list[Advice]) -> list[str]:
    """Advice that brings in fp16/bf16 kernels the asked step did not run, on a GPU of an
    architecture without their fp16 measurement: one line under the GPU's advice (the table's
    own line speaks for the asked step)."""
    asked = next((g.time for g in prediction.gpus if g.gpu == gpu and g.time), None)
    had = set(asked.unmeasured_kernels) if asked is not None else set()
    new = dict.fromkeys(k for a in fits for k in a.unmeasured_kernels if k not in had)
    if not new or (asked is not None and asked.basis == UNMEASURED):  # its own line says it
        return []
    return [
        f"    (the 16-bit advice runs {half_text(new)} no GPU of {gpu}'s architecture had"
        " measured: their times are likely too high)"
    ]


def _with_p90(a: Advice) -> str:
    """The advice's GiB, and its p90 where that prints otherwise: the p90 decides the fit (a
    tight row of 21.8 of 22.0 GiB was told to change to 21.9 / 22.0, whose p90 fits)."""
    memory = f"{a.total_bytes / GIB:.1f}"
    if a.p90_bytes is not None and f"{a.p90_bytes / GIB:.1f}" != memory:
        memory += f" (p90 {a.p90_bytes / GIB:.1f})"
    return memory


def _advice_line(a: Advice) -> str:
    return (
        f"    {a.change}: {_with_p90(a)} / {a.capacity_bytes / GIB:.1f} GiB, "
        f"{a.step_ms:.1f} ms per step, {rate_text(a.samples_per_s)} samples/s"
    )


def layout_lines(found: dict[str, Any]) -> list[str]:
    """The layout search's proposals (``Prediction.layout_advice`` of one GPU), cheapest first."""
    layouts = found.get("layouts") or []
    settings = "".join(f" with {k}={v}" for k, v in (found.get("settings") or {}).items())
    if not layouts:
        reason, near = found.get("reason"), found.get("closest")
        if reason:
            return [f"    no multi-GPU layout searched: {reason}"]
        if near is None:
            return []
        either = f",{settings} or without" if settings else ""
        return [
            f"    no layout of up to {found['max_gpus']} GPUs fits{either} "
            f"({found['searched']} searched); the closest{settings and ','}{settings}:",
            f"      {layout_name(near['layout'])}: {near['gpus']} GPUs, "
            f"{near['p90_bytes'] / GIB:.1f} GiB per GPU (p90) of "
            f"{near['capacity_bytes'] / GIB:.1f} GiB usable",
        ]
    # a GPU without a price is ranked by GPU-seconds (search.rank_key): the header had said
    # "$ per step" above lines that all read "no price" (a hunt)
    priced = any(p["usd_per_step"] is not None for p in layouts)
    basis = "$ per step" if priced else "GPU-seconds per step (no price for this GPU)"
    lines = [
        f"    cheapest layouts that fit{settings} ({found['fitting']} of {found['searched']} fit, searched in "
        f"{found['seconds']:.1f} s; {basis} of the requested batch"
        + (
            f"; cheapest first, within {found['near_tie']:.0%} of each other fewest GPUs first"
            if found.get("near_tie")
            else ""
        )  # fmt: skip
        + "):"
    ]
    for p in layouts:
        usd = p["usd_per_step"]
        cost = f"${usd:.3g} per step" if usd is not None else "no price"
        lines.append(
            f"      {layout_name(p['layout'])}: {p['gpus']} GPUs ({p['nodes']} node{'s' if p['nodes'] > 1 else ''}), "
            f"{p['total_bytes'] / GIB:.1f} / {p['capacity_bytes'] / GIB:.1f} GiB per GPU, "
            f"{p['step_ms']:.0f} ms per step of {p['global_batch']} samples, {cost}"
        )
    return lines


def layout_name(lay: dict[str, Any]) -> str:
    return " ".join(
        [f"{k}={lay[k]}" for k in ("dp", "tp", "pp") if lay[k] > 1]
        + ([lay["sharding"]] if lay["sharding"] != "none" else [])
        + ([f"microbatches={lay['microbatches']}"] if lay["microbatches"] > 1 else [])
        # a schedule other than 1F1B holds more or less: the heading names the one asked
        + ([f"schedule={lay['schedule']}"] if lay.get("schedule", "1f1b") != "1f1b" else [])
        + ([f"virtual_stages={lay['virtual_stages']}"] if lay.get("virtual_stages", 1) > 1 else [])
    )
