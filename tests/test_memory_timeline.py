"""The ``plot=`` memory timeline replays what the table predicts (report/plots.py)."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import tiny_transformer

from boom_ml.gpus import get_gpu
from boom_ml.memory.estimate import estimate_memory, simulate_step
from boom_ml.specs import StepSpec
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.step import trace_step


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    return trace_step(tiny_transformer(), StepSpec(2, seq_len=16, optimizer="adamw"))


def test_timeline_png(tmp_path, graph):
    from boom_ml.report.plots import memory_timeline

    out = memory_timeline(graph, get_gpu("l4"), tmp_path / "timeline.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_timeline_legend_covers_no_curve(tmp_path, graph, monkeypatch):
    """The legend sat in the upper left, over the first step's reserved curve."""
    import matplotlib.pyplot as plt

    from boom_ml.report.plots import memory_timeline

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    memory_timeline(graph, get_gpu("l4"), tmp_path / "timeline.png")
    (ax,) = figures[0].axes
    renderer = figures[0].canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(ax.get_window_extent(renderer))


def test_the_timeline_replays_what_the_table_predicts(graph):
    """The plot's peak is the table's, with the stack's allocator options and accumulation
    (it replayed PyTorch's default allocator and no accumulation, whatever was asked)."""
    from boom_ml.report.plots import timeline_replay
    from boom_ml.stack import resolve_stack

    gpu = get_gpu("l4")
    stack = resolve_stack({"expandable_segments": True})
    drawn = timeline_replay(graph, gpu, stack=stack, grad_accum=2)
    table = estimate_memory(graph, gpu, stack=stack, grad_accum=2)
    assert drawn.total == table.total_bytes
    assert drawn.result.peak_allocated == table.peak_allocated_bytes
    # without accumulation the gradients are freed between steps: another, lower peak
    assert timeline_replay(graph, gpu).result.peak_allocated < table.peak_allocated_bytes


def test_the_timeline_replays_under_the_gpu_limit_where_the_step_fits():
    """Near its limit the allocator frees its cached blocks and retries, as the table's
    replay does: the plot drew the unlimited replay, above the usable line where the table
    said the step fits (a hunt: resnet18 at batch 3000 on an A100-80GB, 88.5 GiB drawn
    against 70.8 in the table). A step that does not fit is drawn without the limit."""
    from boom_ml.report.plots import timeline_replay
    from boom_ml.specs import ModelSpec
    from boom_ml.zoo import build_model

    # segments enough for the allocator to have cached blocks to free (resnet18, batch 64)
    built = build_model(ModelSpec("torchvision:resnet18"))
    graph = trace_step(built, StepSpec(batch_size=64, optimizer="adamw"))
    free = simulate_step(graph, get_gpu("l4"), capacity=False)
    outside = sum(free.outside_bytes.values())
    near = dataclasses.replace(
        get_gpu("l4"), total_memory_bytes=outside + int(0.9 * free.result.peak_reserved)
    )
    drawn, table = timeline_replay(graph, near).result, estimate_memory(graph, near)
    assert table.fit != "no" and not drawn.oom  # the p50 replay, drawn, fits
    assert drawn.peak_reserved == table.peak_reserved_bytes < free.result.peak_reserved
    small = dataclasses.replace(near, total_memory_bytes=outside + free.result.peak_allocated // 2)
    assert estimate_memory(graph, small).fit == "no"
    assert timeline_replay(graph, small).result.peak_reserved == free.result.peak_reserved
