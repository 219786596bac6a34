"""The lines under a prediction's table: which models estimated it, where they extrapolate
(unmeasured architectures, half-precision kernels, bf16 without tensor cores), GPUs without a
price, the software stack and a fine-tuning recipe's bytes."""

from __future__ import annotations

from boom_ml.report.explain import GIB, MIB


def methods_line(memory: str, time: str) -> str:
    """'Memory: M; time: T', a note both methods carry (a recipe's: '(qlora: ...)') once."""
    m_name, _, m_note = memory.partition(" (")
    t_name, _, t_note = time.partition(" (")
    if m_note and m_note == t_note:
        return f"Memory: {m_name}; time: {t_name}; both ({m_note}"
    return f"Memory: {memory}; time: {time}"


def stack_missing_lines(notes: list[tuple[str, str | None]]) -> list[str]:
    """One note per reason the stack cannot run on some GPUs ((gpu id, note) pairs), naming
    them all."""
    by_text: dict[str, list[str]] = {}
    for gpu, note in notes:
        if note:
            # the id as stack.stack_missing places it: "... no kernels for <id> (why) ..."
            by_text.setdefault(note.replace(f" for {gpu} (", " for {gpus} (", 1), []).append(gpu)
    return [f"Note: {text.replace('{gpus}', ', '.join(ids))}." for text, ids in by_text.items()]


def basis_line(bases: list[tuple[str, str | None]]) -> str:
    """A note naming the GPUs (id, time basis) whose architecture no measured GPU shares
    ("" if none). Ids only: a GPU from a user's YAML file has no entry to look up."""
    from boom_ml.timing.basis import UNMEASURED

    ids = [gpu for gpu, basis in bases if basis == UNMEASURED]
    if not ids:
        return ""
    return (
        f"Time on {', '.join(ids)} extrapolates: no GPU of {'its' if len(ids) == 1 else 'their'} "
        "architecture has kernel measurements in training, so every learned correction comes "
        "from other GPUs (README, 'A generation nobody measured')."
    )


def half_line(gaps: list[tuple[str, list[str] | None, str | None]]) -> str:
    """A note naming the step's half-precision kernels that no GPU of the target's
    architecture had measured in fp16, GPUs with the same gaps together ("" if none). GPUs of
    an unmeasured architecture are left to :func:`basis_line`: nothing of theirs was measured.
    ``gaps``: (GPU id, its estimate's ``unmeasured_kernels``, its ``basis``)."""
    from boom_ml.timing.basis import HALF, UNMEASURED, half_text

    by_kinds: dict[str, list[str]] = {}
    for gpu, kinds, basis in gaps:
        if kinds and basis != UNMEASURED:
            by_kinds.setdefault(half_text(kinds, prefix=""), []).append(gpu)
    if not by_kinds:
        return ""
    parts = "; ".join(f"{kinds} on {', '.join(ids)}" for kinds, ids in by_kinds.items())
    return (
        f"No GPU of the same architecture was measured running these in fp16: {HALF}{parts}. "
        "Their times come from other GPUs' kernels and are likely too high (README, 'Forward "
        "passes on GPUs nobody measured a kernel on')."
    )


def count_text(n: int) -> str:
    """A parameter count: millions to one decimal, thousands below 0.1 M (a 38,000-parameter
    model had read 0.0 M), the count itself below 1,000."""
    if n >= 1e5:
        return f"{n / 1e6:.1f} M"
    return f"{n / 1e3:.1f} K" if n >= 1e3 else str(int(n))


def price_line(unpriced: list[str], shown: int) -> str:
    """The GPUs whose $ column is "-" (gpu=all: a count, not 30 ids)."""
    which = ", ".join(unpriced) if len(unpriced) <= 6 else f"{len(unpriced)} of these {shown} GPUs"
    return (
        f"$ / 1k steps: no observed cloud price for {which} (gpus/prices.csv, the SkyPilot "
        "catalog); a GPU YAML file sets one with price_usd_per_hour"
    )


def bf16_line(slow: list[str], math: tuple[str, ...] | list[str] = ()) -> str:
    """The GPUs of a bf16 step without bf16 tensor cores ("" if none); ``math``, those of
    them whose attention runs SDPA's math path."""
    if not slow:
        return ""
    line = (
        f"bf16 on {', '.join(slow)}: no bf16 tensor cores (before Ampere), so bf16 matmuls "
        "are timed at the fp32 rate; amp=fp16 runs on tensor cores from Volta on (Pascal has"
        " none: its fp16 runs on CUDA cores, at the card's fp16 rate)."
    )
    if math:
        # a QLoRA step in bf16 on a T4 held 4.9 GiB where fp16 held 2.5, and said nothing why
        line += (
            f" Nor has SDPA a fused bf16 kernel on {', '.join(math)}: attention runs its math "
            "path, which holds each layer's attention matrix (fp16 keeps the fused kernels)."
        )
    return line


def _size(nbytes: int) -> str:
    """GiB, or MiB below one: 2 MiB on the host had read "0.00 GiB" (a hunt)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _billions(n: int) -> str:
    """A parameter count in billions from one billion, else as :func:`count_text`."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else count_text(n)


def recipe_line(recipe: dict) -> str:
    """Where a fine-tuning recipe puts its bytes (4-bit base weights, adapters, host state)."""
    nbytes = recipe.get("bytes") or {}
    parts = []
    if nbytes.get("base_weights_4bit"):
        parts.append(
            f"base weights 4-bit NF4 {_size(nbytes['base_weights_4bit'])} "
            f"({recipe.get('nf4_layers', 0)} layer{'' if recipe.get('nf4_layers') == 1 else 's'})"
        )
    if recipe.get("fp32_parameters"):
        parts.append(
            f"{recipe['fp32_parameters'] / 1e6:.1f} M parameters kept in fp32 as transformers "
            f"loads this model in {recipe.get('params_dtype')}"
        )
    if recipe.get("unquantized_expert_parameters"):
        parts.append(
            # a count, not bytes: 0.79 M had read "0.00 B" beside MiB figures (a hunt)
            f"MoE expert weights not quantised {_billions(recipe['unquantized_expert_parameters'])}"
            f" parameters ({recipe.get('params_dtype')})"
        )
    if recipe.get("finetune") in ("lora", "qlora"):
        parts.append(
            f"LoRA adapters {count_text(recipe.get('peft_trainable_parameters', 0))} trainable "
            f"({nbytes.get('trainable_parameters', 0) / MIB:.1f} MiB"
            + (f" in {'/'.join(recipe['adapter_dtypes'])}" if recipe.get("adapter_dtypes") else "")
            + ", "
            f"targets {','.join(recipe.get('lora_targets', []))}"
            + (
                f" and parameters {','.join(recipe['lora_target_parameters'])}"
                if recipe.get("lora_target_parameters")
                else ""
            )  # fmt: skip
            + (f": {recipe['lora_targets_chosen']}" if recipe.get("lora_targets_chosen") else "")
            + ")"
        )
    if nbytes.get("optimizer_state_on_host", 0) > MIB:
        parts.append(f"optimizer state on the host {_size(nbytes['optimizer_state_on_host'])}")
    return "Recipe: " + "; ".join(parts) + "." if parts else ""


def stack_label(stack: dict) -> str:
    extras = [f"{stack['module_loading']} module loading"]
    extras += ["cudnn.benchmark"] if stack.get("cudnn_benchmark") else []
    extras += ["expandable_segments"] if stack.get("expandable_segments") else []
    if stack.get("max_split_size_mb") is not None:
        extras.append(f"max_split_size_mb={stack['max_split_size_mb']}")
    return (
        f"torch {stack['torch']}, CUDA {stack['cuda']}, cuDNN {stack['cudnn']}, "
        + ", ".join(extras)
        + " (stack.* keys change it)"
    )


def zero_grad_line(stack: dict, step: dict) -> str:
    """torch 1.x's zero_grad() zeroed gradients in place (set_to_none became its default in
    2.0); a 1.x stack with the 2.x default says which one the step used ('' otherwise)."""
    major = str(stack.get("torch", "2")).split(".")[0]
    if major != "1" or step.get("zero_grad") != "set_to_none":
        return ""
    return (
        f"Note: zero_grad=set_to_none, PyTorch 2.x's default; torch {stack['torch']}'s"
        " zero_grad() zeroes gradients in place (zero_grad=zero)."
    )


METHOD_NAMES = {"gnn": "the GNN", "per-op": "the per-op sum"}


def unlike_line(entries: list[tuple[str, str, float | None]]) -> str:
    """(gpu, fp32 method, per-op ms) of the GPUs where a 16-bit step is timed by another method
    than an fp32 step of its model would be ("" if none): MobileNetV3 at 64 on a T4 came out
    199.7 ms with AMP, per-op, against 137.6 in fp32, by the GNN, whose per-op sum is 269.9 (a
    hunt)."""
    if not entries:
        return ""
    fp32 = entries[0][1]
    ours = "the GNN" if fp32 == "per-op" else "the per-op sum"
    sums = ", ".join(f"{gpu} {ms:.1f} ms" for gpu, _, ms in entries if ms is not None)
    return (
        f"Time: this 16-bit step is timed by {ours}, an fp32 step of this model by "
        f"{METHOD_NAMES.get(fp32, fp32)} (each where it won the held-out CV: README, 'Step time'), "
        f"so set against an fp32 estimate it is not like for like. Per-op sums are: this "
        f"step's {sums}; an fp32 step's, its JSON time.per_op_ms."
    )


def timed_as_line(pairs: list[tuple[str, str]]) -> str:
    """GPUs timed as a packaged GPU they match or beat on every spec number, where the models
    had put them slower (``timing/dominance.py``); '' when none was."""
    if not pairs:
        return ""
    said = ", ".join(f"{gpu} as {other}" for gpu, other in pairs)
    return (
        f"Time: {said}: the models put {'it' if len(pairs) == 1 else 'each'} slower than a"
        " GPU it matches or beats on every spec-sheet number (SMs, clock, bandwidth, L2, peak"
        " rates, power, architecture), so it takes that GPU's estimate (README, 'Per-op time')."
    )
