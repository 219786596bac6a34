"""What a layout's table says: its price (all its GPUs at the GPU's observed on-demand rate,
per 1,000 steps, as one GPU's table prices its step; the layout table had no $ column and its
JSON no price, a hunt) and the schedule in a layout's name."""

from __future__ import annotations

import json

import pytest


def test_a_layout_is_priced_for_all_its_gpus() -> None:
    from boom_ml.gpus import get_gpu
    from boom_ml.predict import run

    base = {"model": "hf:gpt2", "gpu": ["a100-80gb-sxm", "rtx-4090"], "batch_size": 2,
            "seq_len": 128, "advice": False, "cache": False, "parallel": {"dp": 2}}  # fmt: skip
    out = json.loads(run({**base, "output": "json"}))
    priced, unpriced = out["parallel"]
    hourly = get_gpu("a100-80gb-sxm").price_usd_per_hour
    assert priced["price_usd_per_hour"] == pytest.approx(2 * hourly)
    assert priced["usd_per_1000_steps"] == pytest.approx(
        2 * hourly * priced["time"]["step_ms"] * 1000 / 3.6e6
    )
    assert unpriced["usd_per_1000_steps"] is None  # no observed price for an RTX 4090
    text = run(base)
    assert "$ / 1k steps" in text.split("│ a100-80gb-sxm")[0]  # a column of the table
    assert "no observed cloud price for rtx-4090" in text


def test_a_layouts_name_says_its_schedule() -> None:
    """The advice's heading for a GPipe layout that does not fit read "pp=2 microbatches=4
    does not fit": 1F1B holds less, so the schedule asked is named (a hunt)."""
    from boom_ml.report.advice_text import layout_name

    lay = {"dp": 1, "tp": 1, "pp": 2, "sharding": "none", "microbatches": 4}
    assert layout_name({**lay, "schedule": "1f1b", "virtual_stages": 1}) == "pp=2 microbatches=4"
    assert layout_name({**lay, "schedule": "gpipe", "virtual_stages": 1}) == (
        "pp=2 microbatches=4 schedule=gpipe"
    )
    assert layout_name({**lay, "schedule": "interleaved", "virtual_stages": 2}) == (
        "pp=2 microbatches=4 schedule=interleaved virtual_stages=2"
    )


def test_tensor_parallelism_across_nodes_is_said() -> None:
    """tp=4 over nodes of 2 GPUs is accepted (vTrain's tp=16 ran so) and rarely meant: a note
    says that its all-reduces cross the inter-node link (a hunt)."""
    from boom_ml.predict import run

    base = {"model": "hf:meta-llama/Llama-3.2-1B", "gpu": "a100-80gb-sxm", "batch_size": 1,
            "seq_len": 128, "advice": False, "cache": False, "output": "json",
            "parallel": {"tp": 4}}  # fmt: skip
    (entry,) = json.loads(run({**base, "cluster": {"gpus_per_node": 2}}))["parallel"]
    assert "parallel.tp=4 spans 2 nodes of cluster.gpus_per_node=2, so its all-reduces run" in (
        " ".join(entry["notes"]))  # fmt: skip
    (inside,) = json.loads(run(base))["parallel"]
    assert not any("spans" in n for n in inside.get("notes", []))


def test_a_small_models_parameters_are_counted_in_thousands() -> None:
    """A 38,000-parameter model's summary read "0.0 M parameters" (a hunt)."""
    from boom_ml.report.table import count_text

    got = [count_text(n) for n in (25_557_032, 100_000, 38_000, 4_100, 999)]
    assert got == ["25.6 M", "0.1 M", "38.0 K", "4.1 K", "999"]


def test_a_layouts_rows_are_fastest_first() -> None:
    """The layout table listed its GPUs in the order asked (an L4 above an H100, a hunt); like
    one GPU's table it puts the fastest first. The JSON keeps the order asked."""
    from boom_ml.predict import run

    base = {"model": "hf:gpt2", "gpu": ["l4", "a100-80gb-sxm"], "batch_size": 2, "seq_len": 128,
            "advice": False, "cache": False, "parallel": {"dp": 2}}  # fmt: skip
    slow, fast = json.loads(run({**base, "output": "json"}))["parallel"]
    assert (slow["gpu"], fast["gpu"]) == ("l4", "a100-80gb-sxm")
    assert fast["time"]["step_ms"] < slow["time"]["step_ms"]
    text = run(base)
    assert text.index("│ a100-80gb-sxm") < text.index("│ l4 ")


@pytest.mark.parametrize(("sharding", "label"), [
    ("zero1", "other shards' fp32 gradients (ZeRO-1; 16-bit kept)"),
    ("zero2", "gradients on other ranks (ZeRO-2 / FSDP)"),
])  # fmt: skip
def test_explain_names_the_gradient_term_of_the_sharding_asked(sharding, label) -> None:
    """ZeRO-1 over fp32 master weights shards the fp32 gradients alone; explain had called its
    term "ZeRO-2 / FSDP" (a hunt)."""
    from boom_ml.report.explain_layout import _memory_lines

    gib = 2**30
    memory = {"total_bytes": 10 * gib, "p10_bytes": 10 * gib, "p90_bytes": 10 * gib,
              "capacity_bytes": 80 * gib, "fit": "yes", "method": "m", "breakdown": {},
              "parallel_terms": {"zero_gradients": -gib}, "terms": []}  # fmt: skip
    entry = {"gpu": "h100-sxm", "parallel": {"sharding": sharding}, "memory": memory}
    assert f"    {label:<45}    -1.00 GiB" in _memory_lines(entry)
