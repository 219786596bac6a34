"""Pipeline schedules (issue #14): GPipe, 1F1B and interleaved 1F1B simulated from per-stage
forward and backward times (``boom_ml/parallel/schedule.py``), and what they change in the
step time, the per-stage memory and the layout's validation.

Closed forms the simulation must meet exactly (stage times are small dyadic numbers, so every
sum is exact in floating point): with equal stages of forward F and backward B and no transfer
time, 1F1B and GPipe take ``(m + pp - 1)(F + B)``, idle ``(pp - 1)(F + B)`` of it (GPipe paper,
Huang et al. 2019; Narayanan et al. 2021, PipeDream-Flush); interleaved 1F1B over v chunks per
rank (each chunk 1/v of a stage) idles ``(pp - 1)(F + B) / v`` of ``m (F + B) + (pp - 1)(F + B)
/ v`` (Narayanan et al. SC'21, section 2.2: the bubble shrinks by v), a fraction
``(pp - 1) / (v m + pp - 1)``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_llama_config

from boom_ml.errors import InvalidInputError
from boom_ml.parallel.collectives import GroupLink
from boom_ml.parallel.layout import Cluster, Layout, validate
from boom_ml.parallel.schedule import (
    head_in_flight,
    interleaved_warmup,
    peak_in_flight,
    rank_ops,
    schedule_table,
    simulate,
)
from boom_ml.parallel.time import Shape, step_time

REPO = Path(__file__).resolve().parent.parent
F, B = 1.0, 2.0  # forward and backward of one micro-batch on one (virtual) stage, ms
PP_M = [(2, 1), (2, 4), (2, 8), (3, 5), (4, 4), (4, 16), (8, 3), (8, 32)]
PP_M_V = [(2, 2, 2), (2, 4, 2), (2, 4, 4), (3, 6, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4),
          (4, 12, 3), (8, 16, 2)]  # fmt: skip


# --- bubbles of equal stages -------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("pp", "m"), PP_M)
def test_1f1b_and_gpipe_bubble_fraction_is_exact(schedule, pp, m):
    run = simulate([F] * pp, [B] * pp, m, schedule)
    assert run.total_ms == (m + pp - 1) * (F + B)
    assert run.bubble_ms / run.total_ms == (pp - 1) / (m + pp - 1)
    assert run.busy_ms == [m * (F + B)] * pp


@pytest.mark.parametrize(("pp", "m", "v"), PP_M_V)
@pytest.mark.parametrize(("fwd", "bwd"), [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_interleaved_bubble_fraction_is_exact(pp, m, v, fwd, bwd):
    # every chunk takes fwd and bwd (a stage of v chunks takes v times that)
    run = simulate([fwd] * (pp * v), [bwd] * (pp * v), m, "interleaved", pp=pp)
    assert run.total_ms == (v * m + pp - 1) * (fwd + bwd)
    assert run.bubble_ms / run.total_ms == (pp - 1) / (v * m + pp - 1)


@pytest.mark.parametrize(("pp", "m"), PP_M)
def test_simulated_1f1b_equals_the_closed_form_for_equal_stages(pp, m):
    total, bubble = schedule_1f1b([F + B] * pp, m)
    run = simulate([F] * pp, [B] * pp, m, "1f1b")
    assert (run.total_ms, run.bubble_ms) == (total, bubble)


def schedule_1f1b(stage_ms: list[float], microbatches: int) -> tuple[float, float]:
    """1F1B's closed form (fill and drain once, the slowest stage m - 1 more times): the
    reference the simulated 1F1B must equal. (pipeline ms, bubble ms)."""
    slowest = max(stage_ms)
    total = sum(stage_ms) + (microbatches - 1) * slowest
    return total, total - microbatches * slowest


def test_simulated_1f1b_equals_the_closed_form_when_the_last_stage_is_slowest():
    """The head and loss make the last stage the slowest: the closed form holds there too."""
    for pp, m in [(2, 4), (4, 8), (8, 16)]:
        stage = [3.0] * (pp - 1) + [4.5]
        run = simulate([s / 3 for s in stage], [2 * s / 3 for s in stage], m, "1f1b")
        assert run.total_ms == pytest.approx(schedule_1f1b(stage, m)[0], rel=1e-12)


def test_transfers_delay_the_pipeline_and_block_the_sender():
    pp, m, t = 4, 8, 0.25
    free = simulate([F] * pp, [B] * pp, m, "1f1b")
    run = simulate([F] * pp, [B] * pp, m, "1f1b", p2p_ms=t)
    # each rank sends its forward output (not the last) and its input gradient (not the first)
    sends = [1, 2, 2, 1]
    assert run.busy_ms == [m * (F + B + n * t) for n in sends]
    assert run.total_ms > free.total_ms
    # interleaving sends v times as often: every chunk but the model's first and last
    v = 2
    inter = simulate([F] * (pp * v), [B] * (pp * v), m, "interleaved", pp=pp, p2p_ms=t)
    assert inter.busy_ms == [
        m * (v * (F + B) + n * t) for n in (2 * v - 1, 2 * v, 2 * v, 2 * v - 1)
    ]


# --- the operation order -----------------------------------------------------------------


def test_schedule_table_is_megatrons():
    """The example in Megatron-LM's ``forward_backward_pipelining_with_interleaving`` (PP2 N3M5
    VP2: groups of 3 micro-batches, 5 micro-batches, 2 chunks)."""
    table = schedule_table(5, 2, 3)
    assert [i for i, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize(("pp", "m", "v"), PP_M_V)
def test_interleaved_runs_every_chunk_micro_batch_once(pp, m, v):
    for rank in range(pp):
        ops = rank_ops("interleaved", pp, m, v, rank)
        chunks = [c * pp + rank for c in range(v)]
        assert sorted(ops) == sorted((k, j, i) for k in "FB" for j in chunks for i in range(m))
        warm = interleaved_warmup(pp, rank, m, v)
        assert all(k == "F" for k, _, _ in ops[:warm])
        assert warm == min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)
        # a chunk's backwards go in micro-batch order (Megatron pops its FIFO of inputs)
        for j in chunks:
            assert [i for k, jj, i in ops if k == "B" and jj == j] == list(range(m))


# --- activations in flight ---------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), PP_M)
def test_in_flight_gpipe_m_and_1f1b_min_pp_minus_s_m(pp, m):
    assert peak_in_flight("gpipe", pp, m) == [m] * pp
    assert peak_in_flight("1f1b", pp, m) == [min(pp - s, m) for s in range(pp)]
    assert simulate([F] * pp, [B] * pp, m, "1f1b").peak_in_flight == [
        min(pp - s, m) for s in range(pp)
    ]


@pytest.mark.parametrize(("pp", "m", "v"), PP_M_V)
def test_in_flight_interleaved_is_megatrons_warmup_plus_one(pp, m, v):
    # Megatron: (pp - s - 1) * 2 + (v - 1) * pp warm-up chunk-forwards, then one more forward
    # before the first backward; all m * v chunk-micro-batches at most
    expect = [min((pp - s - 1) * 2 + (v - 1) * pp + 1, v * m) for s in range(pp)]
    assert peak_in_flight("interleaved", pp, m, v) == expect


# --- step time and memory ----------------------------------------------------------------


def _profile(layer_ms: float = 3.0):
    from boom_ml.parallel.profile import TimeProfile

    return TimeProfile(layer_ms=layer_ms, first_ms=0.0, last_ms=0.0, opt_layer_ms=0.0,
                       opt_ends_ms=0.0, backward_fraction=0.5, method="synthetic")  # fmt: skip


def _groups(pp: int) -> dict[str, GroupLink]:
    sizes = (("tp", 1), ("dp", 1), ("pp", pp), ("embedding", min(pp, 2)))
    return {name: GroupLink(name, n, "nvlink4", 370.0, 3.4, 8.4) for name, n in sizes}


SHAPE = Shape(batch_size=2, seq_len=32, hidden=64, act_bytes=2, checkpointing=False,
              params_layer=1000, params_first=100, params_last=100)  # fmt: skip


def test_step_time_reports_the_schedule_and_interleaving_shrinks_the_bubble():
    pp, m = 2, 4
    one = step_time(_profile(), SHAPE, Layout(pp=pp, microbatches=m), [2, 2], _groups(pp))
    gpipe = step_time(_profile(), SHAPE, Layout(pp=pp, microbatches=m, schedule="gpipe"),
                      [2, 2], _groups(pp))  # fmt: skip
    inter = step_time(_profile(), SHAPE,
                      Layout(pp=pp, microbatches=m, schedule="interleaved", virtual_stages=2),
                      [2, 2], _groups(pp))  # fmt: skip
    assert (one["schedule"], one["virtual_stages"]) == ("1f1b", 1)
    assert (inter["schedule"], inter["virtual_stages"]) == ("interleaved", 2)
    # equal stages: GPipe's forwards wait for each blocking send of the stage before (1F1B
    # overlaps them with the other direction's work), so its bubble is a little larger
    assert one["bubble_ms"] < gpipe["bubble_ms"] < 1.01 * one["bubble_ms"]
    assert inter["bubble_ms"] < one["bubble_ms"]
    # equal stages; the point-to-point sends are tiny next to 3 ms layers
    assert one["bubble_ms"] / one["pipeline_ms"] == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-2)
    assert inter["bubble_ms"] / inter["pipeline_ms"] == pytest.approx(
        (pp - 1) / (2 * m + pp - 1), rel=1e-2
    )

    def sends(out):
        (c,) = [c for c in out["collectives"] if c["group"] == "pp"]
        return c["calls"]

    # the sends of the first rank (its receives are the other ranks' sends): 1 per
    # micro-batch, 2 per extra chunk
    assert sends(one) == m and sends(inter) == (4 * 2 - 2) // 2 * m
    for key in ("step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "bubble_ms",
                "bubble_fraction", "pipeline_ms", "optimizer_ms", "critical_stage",
                "collectives", "per_stage", "method"):  # fmt: skip
        assert key in inter


def test_step_time_1f1b_equals_the_closed_form_and_gpipe_without_sends():
    pp, m = 4, 8
    groups = {**_groups(pp), "pp": GroupLink("pp", 1, "none", 1.0, 0.0, 0.0)}  # no send cost
    out = step_time(_profile(), SHAPE, Layout(pp=pp, microbatches=m), [1] * pp, groups)
    micro = [st["micro_ms"] for st in out["per_stage"]]
    total, bubble = schedule_1f1b(micro, m)
    assert out["pipeline_ms"] == pytest.approx(total, abs=1e-4)
    assert out["bubble_ms"] == pytest.approx(bubble, abs=1e-4)
    gpipe = step_time(_profile(), SHAPE, Layout(pp=pp, microbatches=m, schedule="gpipe"),
                      [1] * pp, groups)  # fmt: skip
    assert (gpipe["step_ms"], gpipe["bubble_ms"]) == (out["step_ms"], out["bubble_ms"])


@pytest.fixture(scope="module")
def tiny_memory():
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.memory_profile import memory_profile
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=2, seq_len=32, optimizer="adamw", grad_accum=4)
    return memory_profile(tiny_llama_config(vocab_size=256), 1, step, get_gpu("h100-sxm"))


def test_memory_holds_what_the_schedule_keeps_in_flight(tiny_memory):
    from boom_ml.parallel.memory import rank_memory

    m = 4
    # one layer per stage: what a micro-batch's forward leaves for its backward, a layer's
    # share (2-layer trace less 1-layer) on the first stage, the whole 1-layer trace's
    # (the layer, the head's logits and loss) on the last
    one, two = tiny_memory.held
    gpipe = rank_memory(tiny_memory, Layout(pp=2, microbatches=m, schedule="gpipe"), [1, 1])
    for st, held in zip(gpipe["per_stage"], (two - one, one), strict=True):
        assert st["in_flight_microbatches"] == m == st["in_flight_chunks"]
        assert st["parallel_terms"]["pipeline_activations"] == (m - 1) * held
    one = rank_memory(tiny_memory, Layout(pp=2, microbatches=m), [1, 1])
    assert [st["in_flight_microbatches"] for st in one["per_stage"]] == [2, 1]
    assert gpipe["total_bytes"] > one["total_bytes"]
    # interleaved, 2 chunks of 1 layer per rank: rank 0 holds 2 + 2 + 1 = 5 chunk-micro-
    # batches (Megatron's warm-up + 1), 2.5 stage micro-batches
    inter = rank_memory(tiny_memory, Layout(pp=2, microbatches=m, schedule="interleaved",
                                            virtual_stages=2), [2, 2])  # fmt: skip
    first, last = inter["per_stage"]
    assert (first["in_flight_chunks"], first["in_flight_microbatches"]) == (5, 2.5)
    assert (last["in_flight_chunks"], last["in_flight_microbatches"]) == (3, 1.5)
    # of those 3, the last rank's warm-up runs its first chunk: one head in flight, the traced
    # step's own (a hunt: each half micro-batch had carried the head's logits)
    layer = tiny_memory.held[1] - tiny_memory.held[0]
    assert last["parallel_terms"]["pipeline_activations"] == 0.5 * 2 * layer


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v", "heads"),
    [("1f1b", 4, 8, 1, 1), ("gpipe", 4, 8, 1, 8), ("gpipe", 2, 4, 2, 4),
     ("interleaved", 2, 4, 2, 1), ("interleaved", 4, 8, 2, 1), ("interleaved", 2, 2, 2, 1)],
)  # fmt: skip
def test_heads_in_flight_on_the_last_rank(schedule, pp, m, v, heads):
    """Micro-batches of the model's last chunk (the head's) in flight at the last rank's
    peak: every one under GPipe, the one being backpropagated under 1F1B and interleaving."""
    assert head_in_flight(schedule, pp, m, v) == heads


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "facts", "words"),
    [
        (Layout(schedule="interleaved", virtual_stages=2), {}, "needs parallel.pp >= 2"),
        (Layout(pp=4, microbatches=6, schedule="interleaved", virtual_stages=2), {},
         "microbatches=6 is not a multiple of parallel.pp=4"),
        (Layout(pp=4, microbatches=8, schedule="interleaved", virtual_stages=2), {"layers": 12},
         "12 layers do not split into parallel.pp x parallel.virtual_stages = 8"),
    ],
)  # fmt: skip
def test_bad_interleaved_layouts_raise_one_line(layout, facts, words):
    with pytest.raises(InvalidInputError) as err:
        validate(layout, Cluster(), **facts)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_good_interleaved_layout_passes():
    layout = Layout(pp=4, microbatches=8, schedule="interleaved", virtual_stages=2)
    validate(layout, Cluster(), layers=32, heads=32, hidden=4096)


# --- the CLI -----------------------------------------------------------------------------


def test_cli_gpipe_holds_more_activations_than_1f1b_with_the_same_bubble(tmp_path):
    from boom_ml.predict import run

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_llama_config(vocab_size=256, num_hidden_layers=4)))
    base = {"model": f"hf:{path}", "gpu": "h100-sxm", "batch_size": 2, "seq_len": 32,
            "advice": False, "output": "json"}  # fmt: skip

    def entry(**parallel):
        (out,) = json.loads(run({**base, "parallel": {"pp": 2, "microbatches": 4, **parallel}}))[
            "parallel"
        ]
        return out

    gpipe, one = entry(schedule="gpipe"), entry(schedule="1f1b")

    def pipeline_activations(out):
        return sum(st["parallel_terms"].get("pipeline_activations", 0)
                   for st in out["memory"]["per_stage"])  # fmt: skip

    assert pipeline_activations(gpipe) > pipeline_activations(one)
    assert gpipe["time"]["bubble_ms"] == one["time"]["bubble_ms"]
    assert gpipe["time"]["schedule"] == "gpipe" and one["time"]["schedule"] == "1f1b"
    inter = entry(schedule="interleaved", virtual_stages=2)
    assert inter["parallel"]["layers_per_chunk"] == [[1, 1], [1, 1]]
    assert inter["time"]["bubble_ms"] < one["time"]["bubble_ms"]
    with pytest.raises(InvalidInputError, match="do not split"):
        run({**base, "parallel": {"pp": 2, "microbatches": 4, "schedule": "interleaved",
                                  "virtual_stages": 4}})  # fmt: skip


def test_cli_bad_interleaved_layout_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "boom_ml.predict", "model=hf:gpt2", "parallel.pp=4",
         "parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.microbatches=6",
         "output=json"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "multiple of" in lines[0]
    assert proc.stdout == ""


def test_no_memory_category_of_a_stage_goes_below_zero():
    """Llama-3-8B's shipped config at 1 x 1024, bf16 autocast, checkpointing, 2 GPipe stages
    of 8 micro-batches: its 1-layer model peaks outside the optimizer as the head's gradient
    is cast in the backward, its 2-layer model in the loss's forward; a line through those
    two moments put the last stage's gradients at -10.5 GiB. Each part of the step is now
    extrapolated on its own."""
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.layout import Cluster
    from boom_ml.parallel.predict import predict_raw
    from boom_ml.parallel.shard import load_raw
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=1, seq_len=1024, amp="bf16", checkpointing="full")
    layout = Layout(pp=2, microbatches=8, schedule="gpipe")
    raw = load_raw("hf:meta-llama/Meta-Llama-3-8B")
    (entry,) = predict_raw(raw, [get_gpu("h100-sxm")], step, layout, Cluster())
    assert len(entry["memory"]["per_stage"]) == 2
    for stage in entry["memory"]["per_stage"]:
        assert min(stage["breakdown"].values()) >= 0, stage["breakdown"]
