"""Per-op profiles of a real training step, mapped onto the traced OpGraph's nodes.

``data_collection.step_runner`` runs one more step of a profiled configuration under
``torch.profiler`` with its phases marked (``record_function("boom::<phase>")``); this
module flattens the profiler's op tree and aligns it with the tracer's nodes
(``op_profiles`` rows: kernel names and device time per node; CPU time on a CPU).
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Protocol

import torch

from boom_ml.specs import ModelSpec
from boom_ml.trace.sdpa_select import sdpa_group
from boom_ml.zoo import build_model
from data_collection import schema


class ProfiledRunner(Protocol):
    """What :func:`profile_rows` needs of a step runner (``step_runner.StepRunner`` is one):
    its resolved step, phase markers it can swap, and one step when called."""

    step: Any
    marks: Callable[[str], contextlib.AbstractContextManager]

    def __call__(self) -> Any: ...


def no_mark(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


MARK = "boom::"  # record_function prefix of the step's phase markers
SEGMENTS = {"zero_grad": ("zero_grad",), "input": ("input",), "forward": ("forward", "loss"),
            "backward": ("backward", "recompute"), "optimizer": ("optimizer",)}  # fmt: skip


def canon(name: str) -> str:
    """One spelling for ops that CPU traces and CUDA runs name differently."""
    name = name.removeprefix("aten::").removeprefix("aten.").split(".")[0]
    if name.startswith(("_scaled_dot_product_", "_flash_attention", "_efficient_attention")):
        return "sdpa_backward" if "backward" in name else "sdpa"  # flash/efficient/cudnn/cpu
    if "batch_norm" in name:  # native_/cudnn_/_native_..._legit/_with_update
        return "batch_norm_backward" if "backward" in name else "batch_norm"
    return name


def align(
    nodes: Any, events: list[Any], cuda: bool
) -> tuple[dict[int, tuple[float, list[str]]], float]:
    """Map profiled aten ops onto OpGraph nodes: ``{node id: (us, kernel names)}``, total us.

    The profiler sees a tree (``aten::linear`` > ``aten::matmul`` > ``aten::mm``) while the
    tracer saw only the ops below autograd. Per phase (from the markers the step records),
    the tree is flattened in time order, stopping at the first op whose name some node of
    that phase has (it takes its whole subtree's kernels); then the two name sequences are
    aligned as a diff, so ops only one side has (a mask built another way, a sync) leave
    their neighbours' matches intact.
    """
    start = lambda e: e.time_range.start  # noqa: E731
    marks = sorted((e.time_range.start, e.time_range.end, e.name[len(MARK):])
                   for e in events if e.name.startswith(MARK))  # fmt: skip
    wanted: dict[str, list[tuple[int, str]]] = {seg: [] for seg in SEGMENTS}
    for node in nodes.itertuples():
        seg = next((s for s, phases in SEGMENTS.items() if node.phase in phases), None)
        if seg is not None:
            wanted[seg].append((int(node.id), canon(node.aten_op)))
    known = {seg: {name for _, name in pairs} for seg, pairs in wanted.items()}
    seen: dict[str, list[Any]] = {seg: [] for seg in SEGMENTS}

    def visit(e: Any) -> None:
        seg = next((m[2] for m in marks if m[0] <= start(e) <= m[1]), None)
        if seg in seen and e.name.startswith("aten::") and canon(e.name) in known[seg]:
            seen[seg].append(e)
            return
        for child in sorted(e.cpu_children, key=start):
            visit(child)

    for root in sorted((e for e in events if e.cpu_parent is None), key=start):
        if root.device_type == torch.autograd.DeviceType.CPU:
            visit(root)
    found: dict[int, tuple[float, list[str]]] = {}
    for seg, pairs in wanted.items():
        got = seen[seg]
        diff = difflib.SequenceMatcher(None, [n for _, n in pairs], [canon(e.name) for e in got],
                                       autojunk=False)  # fmt: skip
        for a, b, size in diff.get_matching_blocks():
            for i in range(size):
                found[pairs[a + i][0]] = _cost(got[b + i], cuda)
    if cuda:
        total = sum(k.duration for e in events for k in e.kernels)
    else:  # CPU: the step's own time, i.e. the markers' spans
        total = sum(e.cpu_time_total for e in events if e.name.startswith(MARK))
    return found, float(total)


def _cost(e: Any, cuda: bool) -> tuple[float, list[str]]:
    """Device time (us) and kernel names of an op's subtree; CPU time on the CPU."""
    if not cuda:
        return float(e.cpu_time_total), []
    us, names = float(sum(k.duration for k in e.kernels)), [k.name for k in e.kernels]
    for child in e.cpu_children:
        c_us, c_names = _cost(child, cuda)
        us, names = us + c_us, names + c_names
    return us, names


def profile_rows(
    runner: ProfiledRunner, config: Mapping[str, Any], key: str, dev: torch.device,
    base: Mapping[str, Any], step_row: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], str]:  # fmt: skip
    """op_profiles rows of one profiled step, and a note on how much time they cover."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from boom_ml.trace.step import trace_step

    cuda = dev.type == "cuda"
    step = runner.step
    if cuda:  # traced with the SDPA kernels this GPU's dispatcher picks (trace/sdpa_select.py)
        major, minor = torch.cuda.get_device_capability(dev)
        build = SimpleNamespace(
            cuda=torch.version.cuda or "0", cudnn=torch.backends.cudnn.version()
        )
        step = replace(step, sdpa_group=sdpa_group(major * 10 + minor, build))
    graph = trace_step(build_model(ModelSpec(config["model"], dict(config["options"]))), step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runner.marks = lambda name: record_function(MARK + name)
    try:
        with profile(activities=activities) as prof:
            runner()
            if cuda:
                torch.cuda.synchronize(dev)
    finally:
        runner.marks = no_mark
    found, total = align(graph.nodes, list(prof.events()), cuda)
    rows = []
    for node in graph.nodes.itertuples():
        if int(node.id) not in found:
            continue
        us, names = found[int(node.id)]
        out_dtypes = json.loads(node.output_dtypes)
        rows.append({
            **{c: None for c in schema.columns("op_profiles")},
            "source": base["source"], "step_key": key, "gpu_id": base["gpu_id"],
            "device_name": base["device_name"], "device_kind": base["device_kind"],
            "model": step_row["model"], "batch_size": step_row["batch_size"],
            "seq_len": step_row["seq_len"], "image_size": step_row["image_size"],
            "phase_scope": step_row["phase_scope"], "variant": step_row["variant"],
            "scope": "step", "node_index": int(node.id), "node_name": f"{node.module}/{node.op}",
            "node_kind": "call_function", "op": node.op, "input_shapes": node.input_shapes,
            "output_shape": node.output_shapes, "dtype": out_dtypes[0] if out_dtypes else None,
            "kernel_names": ";".join(dict.fromkeys(names))[:2000] or None,
            "duration_ms": us / 1e3,
            # Harness columns beyond the canonical schema (kept in shards, dropped on merge):
            "phase": node.phase, "module": node.module, "family": node.family,
            "amp": config["amp"], "checkpointing": config["checkpointing"],
        })  # fmt: skip
    mapped = sum(found[i][0] for i in found)
    share = mapped / total if total else 0.0
    note = f"op_profile: {len(found)}/{graph.num_ops} nodes, {share:.0%} of {'kernel' if cuda else 'cpu'} time"
    return rows, note
