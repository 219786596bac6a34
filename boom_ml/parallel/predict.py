"""``predict_parallel``: per-GPU memory of the worst rank and the step time of a layout.

One trace pair (1 and 2 layers of the tensor-parallel rank's model) serves every stage,
every data-parallel replica and every GPU count: the cost does not grow with the job's size.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from boom_ml.estimates import usd_per_1000_steps
from boom_ml.gpus.spec import GpuSpec
from boom_ml.parallel.collectives import groups as make_groups
from boom_ml.parallel.layout import Cluster, Layout, validate
from boom_ml.parallel.links import inter_link, intra_link
from boom_ml.parallel.memory import rank_memory
from boom_ml.parallel.memory_profile import memory_profile
from boom_ml.parallel.profile import param_counts, time_profiles
from boom_ml.parallel.shard import (
    check_model,
    chunk_layers,
    load_raw,
    stage_layers,
    with_build_options,
)
from boom_ml.parallel.time import DISPATCH_US, Shape, step_time
from boom_ml.specs import StepSpec
from boom_ml.timing.basis import basis, measured_gpus
from boom_ml.trace.cudnn_from_flash import trace_order
from boom_ml.trace.sdpa_select import sdpa_group

DECODER_SEQ_LEN = 2048  # the zoo's default for decoders (boom_ml/zoo/hf_models.py)


def _seq_len(raw: dict[str, Any], step: StepSpec) -> int:
    """Tokens per sample: a vision transformer's patches and its class token (HF ViT/DeiT/BEiT
    configs: image_size, patch_size; a distillation or register token more is left out; it
    reads no seq_len), else the step's, else the model's positions capped at DECODER_SEQ_LEN."""
    patch = raw.get("patch_size")
    if isinstance(patch, int) and patch > 0 and (step.image_size or raw.get("image_size")):
        side = int(step.image_size or raw["image_size"]) // patch
        return side * side + 1
    if step.seq_len:
        return step.seq_len
    limit = raw.get("max_position_embeddings") or raw.get("n_positions") or DECODER_SEQ_LEN
    return min(int(limit), DECODER_SEQ_LEN)


def attention_groups(gpus: list[GpuSpec], stack: Any = None) -> dict[str, list[GpuSpec]]:
    """The GPUs by attention architecture group (``trace/sdpa_select.py``), in the order their
    groups are traced (a flash group before the cuDNN groups it re-expresses for)."""
    by_group: dict[str, list[GpuSpec]] = {}
    for gpu in gpus:
        by_group.setdefault(sdpa_group(gpu.sm_version, stack), []).append(gpu)
    return {group: by_group[group] for group in trace_order(list(by_group))}


def predict_raw(
    raw: dict[str, Any], gpus: list[GpuSpec], step: StepSpec, layout: Layout, cluster: Cluster,
    stack: Any = None, memory: bool = True, compute_scale: float = 1.0,
    grad_bytes: int | None = None, overlap_grad_reduce: bool = True,
    dispatch_us: float = DISPATCH_US, other_scale: float = 1.0, full_recompute: bool = False,
    time_if_fits: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """``predict_parallel`` on an HF config dict (the validation builds Megatron GPT configs).

    ``grad_bytes`` is the size of one gradient element on the wire (default: the trainable
    parameters' element, 4 under PyTorch AMP, which keeps fp32 parameters and gradients);
    ``overlap_grad_reduce=False`` reduces all gradients after the backward (Megatron without
    gradient buckets); ``compute_scale`` multiplies compute times;
    ``full_recompute``: checkpointing re-runs whole layers (Megatron), so their recompute repeats
    both tensor-parallel all-reduces (PyTorch's non-reentrant checkpoint stops before the last).
    ``time_if_fits``: a GPU whose worst rank does not fit gets ``fits`` and ``memory`` alone
    (a layout search times only the layouts it can propose).
    """
    facts = check_model(raw, layout)
    validate(
        layout, cluster, **facts, finetune_method=step.finetune_method, optimizer=step.optimizer
    )
    per_stage = stage_layers(int(facts["layers"]), layout.pp)
    time_step = replace(step, grad_accum=1)
    mem_step = replace(step, grad_accum=max(layout.microbatches, step.grad_accum))
    # the rank's model is traced for each attention group (its GPUs' SDPA kernels), the
    # first group's graphs re-expressed or reused for the others where they can be
    groups_of = attention_groups(gpus, stack)
    counts = param_counts(raw, layout.tp, replace(time_step, sdpa_group=next(iter(groups_of))))
    # activations in 16 bits under autocast or 16-bit parameters
    half = step.amp in ("fp16", "bf16") or step.params_dtype != "fp32"
    tied_last = layout.pp > 1
    shape = Shape(
        batch_size=step.batch_size,
        seq_len=_seq_len(raw, step),
        hidden=int(facts["hidden"]),
        act_bytes=2 if half else 4,
        residual_bytes=4 if step.params_dtype == "fp32" else 2,
        checkpointing=step.checkpointing != "none",
        params_layer=counts["layers"],
        params_first=counts["first"],
        params_last=counts["last"] + (counts["tied"] if tied_last else 0),
        trainable_layer=counts["trainable_layers"],
        trainable_first=counts["trainable_first"],
        trainable_last=counts["trainable_last"] + (counts["trainable_tied"] if tied_last else 0),
        logical_layer=counts["logical_layers"],
        logical_first=counts["logical_first"],
        logical_last=counts["logical_last"] + (counts["logical_tied"] if tied_last else 0),
        grad_bytes=grad_bytes or counts["trainable_bytes"],
        param_bytes=counts["bytes"],
        overlap_grad_reduce=overlap_grad_reduce,
        full_recompute=full_recompute,
    )
    out = []
    # one timing call per attention group for its GPUs
    profiles: dict[str, Any] = {}
    for group, members in groups_of.items():
        step_g = replace(time_step, sdpa_group=group)
        timed = time_profiles(raw, layout.tp, step_g, members)
        profiles.update(zip((g.id for g in members), timed, strict=True))
    group_of = {gpu.id: group for group, members in groups_of.items() for gpu in members}
    measured = measured_gpus()
    for gpu in gpus:
        if memory:
            step_g = replace(mem_step, sdpa_group=group_of[gpu.id])
            mprof = memory_profile(raw, layout.tp, step_g, gpu, stack)
            rank = rank_memory(mprof, layout, per_stage)
            if time_if_fits and not rank["fits"]:
                out.append({"gpu": gpu.id, "memory": rank, "fits": False})
                continue
        tprof = profiles[gpu.id]
        node_gpus = min(layout.world, cluster.gpus_per_node)
        intra = intra_link(cluster, gpu.id, gpu.name, gpu.architecture, node_gpus)
        inter = inter_link(cluster, gpu.architecture)
        groups = make_groups(layout, cluster, intra, inter)
        time = step_time(
            tprof,
            shape,
            layout,
            per_stage,
            groups,
            counts["trainable_tied"],
            compute_scale,
            dispatch_us,
            other_scale,
        )
        global_batch = step.batch_size * layout.microbatches * layout.dp
        price = gpu.price_usd_per_hour
        hourly = None if price is None else price * layout.world  # the layout's GPUs
        time["global_batch"] = global_batch
        time["samples_per_s"] = round(global_batch / time["step_ms"] * 1e3, 3)
        time["basis"] = basis(gpu, measured) if measured else None  # as a one-GPU estimate's
        time["unmeasured_kernels"] = list(tprof.unmeasured_kernels)  # as a one-GPU estimate's
        if "bf16" in (step.amp, step.params_dtype):  # as session.py sets a one-GPU estimate's
            time["bf16_tensor_cores"] = gpu.bf16_tensor_cores
        # the links the collectives were timed on (cluster.intra/inter=auto names none)
        time["links"] = {"intra": intra.name, "intra_busbw_gbs": intra.busbw_gbs}
        if cluster.nodes(layout) > 1:
            time["links"].update(inter=inter.name, inter_busbw_gbs=inter.busbw_gbs)
        entry: dict[str, Any] = {
            "gpu": gpu.id,
            "name": gpu.name,
            "parallel": {
                **layout.to_dict(),
                "cluster": cluster.to_dict(),
                "nodes": cluster.nodes(layout),
                "seq_len": shape.seq_len,  # the step's, or the model's default the zoo takes
                "layers_per_stage": per_stage,
                # per rank, its model chunks' layers (interleaved: rank r holds r, r + pp, ...)
                "layers_per_chunk": chunk_layers(per_stage, layout.virtual_stages),
                "links": {k: g.to_dict() for k, g in groups.items()},
                "link_sources": {intra.name: intra.source, inter.name: inter.source},
            },
            "time": time,
            # the whole layout's on-demand price, as one GPU's table prices its step (None:
            # no observed price for the GPU)
            "price_usd_per_hour": hourly,
            "usd_per_1000_steps": usd_per_1000_steps(hourly, time["step_ms"]),
        }
        if counts.get("recipe"):  # LoRA's targets and adapter dtypes, as a one-GPU graph has
            entry["recipe"] = dict(counts["recipe"])
        if memory:
            entry["memory"] = rank
            entry["fits"] = rank["fits"]
            entry["notes"] = layout_notes(layout, step, entry["memory"])
        if layout.tp > cluster.gpus_per_node:
            # accepted (vTrain's tp=16 ran so), and rarely meant: said beside the layout
            entry.setdefault("notes", []).append(
                f"parallel.tp={layout.tp} spans {-(-layout.tp // cluster.gpus_per_node)} nodes"
                f" of cluster.gpus_per_node={cluster.gpus_per_node}, so its all-reduces run over"
                f" the inter-node link ({inter.name}); the advisor's layouts keep tp in a node"
            )
        out.append(entry)
    return out


def layout_notes(layout: Layout, step: StepSpec, memory: dict[str, Any]) -> list[str]:
    """What a user of the layout may read wrongly: autocast's 16-bit weight copies under
    FSDP / ZeRO-3, which gather fp32 parameters (FSDP2 without a MixedPrecisionPolicy)."""
    copies = memory.get("breakdown", {}).get("autocast_copy", 0)
    if not layout.fsdp2 or step.amp == "none" or copies <= 0:
        return []
    return [
        f"{layout.sharding} gathers fp32 parameters and autocast keeps a {step.amp} copy of each"
        f" weight it casts ({copies / 2**30:.2f} GiB on the worst rank), as FSDP2 without a"
        " MixedPrecisionPolicy runs; one with param_dtype=bf16 gathers 16-bit parameters and"
        " makes no copies: params_dtype=bf16 master_weights=true is the nearest step modelled"
    ]


def predict_parallel(
    model: str, gpus: list[GpuSpec], step: StepSpec, layout: Layout, cluster: Cluster,
    stack: Any = None, options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per GPU: ``parallel`` (layout, links), ``memory`` (worst rank, ``per_stage`` when
    pp > 1), ``time`` (step over the global batch, compute / comm / exposed / bubble and
    per-collective attributions) and ``fits``. ``model`` is ``hf:<id or config path>``;
    ``options`` the zoo's build options (attention implementation, MoE imbalance)."""
    raw = with_build_options(load_raw(model), options)
    return predict_raw(raw, gpus, step, layout, cluster, stack=stack)
