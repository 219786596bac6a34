"""The xMem validation pipeline: fitting, per-run prediction, tables, table update.

Ground truths here are synthetic (built from the simulator's own output), except in
``test_xmem_runs_load`` (the shape of the shared dataset) and
``test_held_out_model_error_on_real_runs`` (real measured peaks of held-out models).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from tiny_models import tiny_cnn

from boom_ml.gpus import get_gpu
from boom_ml.memory import overheads
from boom_ml.memory.overheads import load_overheads
from boom_ml.specs import StepSpec
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.step import trace_step
from training import validate_memory as vm

MiB = 1 << 20


class TinyTraces(vm.Traces):
    """Traces the synthetic CNN whatever the config names."""

    def __init__(self) -> None:
        super().__init__(None)

    def trace(self, cfg: vm.Config, batch: int) -> OpGraph:
        self.traced += 1
        return trace_step(tiny_cnn(), StepSpec(batch, image_size=16, optimizer=cfg.optimizer))


def synthetic_runs(batches: list[int], offset: int, traces: vm.Traces) -> pd.DataFrame:
    """Runs whose 'measured' peak is the replay's reserved peak plus ``offset``."""
    gpu = get_gpu("rtx-3060")
    table = load_overheads().with_values(lazy_kernels=0)
    base = pd.DataFrame(
        {
            "model": "test:tiny-cnn", "num_classes": 10, "optimizer": "adamw",
            "image_size": 16, "seq_len": None, "batch_size": batches,
            "n_optimizer_steps": 4, "real_oom": False, "xmem_oom": False,
            "xmem_error": 0.03, "dnnmem_error": 0.2, "schedtune_error": 0.2,
        }
    )  # fmt: skip
    sims = vm.simulate_configs(base.assign(ground_truth_peak_bytes=1), gpu, table, traces)
    reserved = base.merge(sims, on=["model", "optimizer", "batch_size"])["reserved"]
    return base.assign(ground_truth_peak_bytes=reserved + offset), sims, table


def test_fit_recovers_a_known_offset():
    traces = TinyTraces()
    runs, sims, _ = synthetic_runs([2, 3, 4, 5, 6], 100 * MiB, traces)
    data = runs.merge(sims.drop(columns=["graph"]), on=["model", "optimizer", "batch_size"])
    assert vm.fit_lazy_kernels(data) == 100 * MiB
    # Five batch sizes: three traced, two written by the affine batch scaling.
    assert traces.traced == 3


def test_prediction_and_summary():
    traces = TinyTraces()
    runs, sims, table = synthetic_runs([2, 4], 64 * MiB, traces)
    gpu = get_gpu("rtx-3060")
    pred = vm.predict(runs, sims, gpu, table, 64 * MiB)
    stack = vm.resolve_stack(vm.XMEM_STACK)
    terms = table.outside(gpu, sims["graph"].iloc[0], stack)
    # the context's own terms: driver baseline + 28 SMs x 1536 threads x 1 KiB + heaps
    context = sum(a.nbytes for a in terms if a.library == "cuda")
    assert context == 171966464 + 28 * 1536 * 1024 + (1 << 20) + (8 << 20)
    assert np.allclose(pred["err"], 0)
    assert (pred["pred_total"] - pred["pred_measured"] == context).all()
    assert not pred["pred_oom"].any()
    s = vm.summary(pred, "test")
    assert list(s["model"]) == ["test:tiny-cnn", "ALL"]
    assert s["ours_%"].iloc[-1] == 0 and s["xMem_%"].iloc[-1] == pytest.approx(3.0)
    assert s["oom_agree"].iloc[-1] == "2/2"


def test_oom_verdict_on_a_device_too_small():
    import dataclasses

    traces = TinyTraces()
    runs, sims, table = synthetic_runs([4], 0, traces)
    small = dataclasses.replace(
        get_gpu("rtx-3060"), total_memory_bytes=216 * MiB
    )  # context ~215 MiB
    pred = vm.predict(runs, sims, small, table, 0)
    assert pred["pred_oom"].all()


def test_write_fitted_term(tmp_path, monkeypatch):
    path = tmp_path / "overheads.csv"
    path.write_text(overheads.TABLE_PATH.read_text())
    monkeypatch.setattr(vm, "TABLE_PATH", path)
    before = {t.term: t for t in load_overheads(path).terms}
    vm.write_fitted_term(123 * MiB, 42)
    after = {t.term: t for t in load_overheads(path).terms}
    fitted = after[vm.FITTED_TERM]
    assert fitted.nbytes == 123 * MiB and fitted.provenance.startswith("fitted:")
    assert "42 non-OOM" in fitted.provenance
    assert fitted.version == before[vm.FITTED_TERM].version + (
        before[vm.FITTED_TERM].nbytes != 123 * MiB
    )
    assert {k: v for k, v in after.items() if k != vm.FITTED_TERM} == {
        k: v for k, v in before.items() if k != vm.FITTED_TERM
    }


def test_xmem_workload_turns_on_the_cache_and_eager_t5():
    from boom_ml.specs import ModelSpec
    from boom_ml.zoo import build_model

    built = build_model(ModelSpec("hf:t5-small"))
    vm.xmem_workload(built)
    m = built.module
    assert m.config._attn_implementation == "eager"
    assert m.decoder.config.use_cache and not m.encoder.config.use_cache
    cnn = build_model(ModelSpec("torchvision:mnasnet1_0", options={"num_classes": 10}))
    vm.xmem_workload(cnn)  # nothing to change for a torchvision model


def test_xmem_runs_load():
    try:
        runs = vm.load_runs()
    except FileNotFoundError:
        pytest.skip("shared xMem data not available")
    assert len(runs) == 229 and runs["real_oom"].sum() == 40
    assert set(runs["model"]) >= set(vm.FIT_MODELS)
    needed = {"ground_truth_peak_bytes", "n_optimizer_steps", "xmem_error", "dnnmem_error"}
    assert needed <= set(runs.columns)


@pytest.mark.parametrize(
    "model", ["torchvision:mobilenet_v3_large", "hf:cerebras/Cerebras-GPT-111M"]
)
def test_held_out_model_error_on_real_runs(model):
    """Real measurements: the packaged memory model, whose one fitted term was fitted on the
    other models' runs, predicts a held-out model's xMem peaks within the issue's 5 % median."""
    assert model not in vm.FIT_MODELS
    runs = vm.load_runs()
    runs = runs[runs["model"] == model]
    gpu = get_gpu("rtx-3060")
    packaged = load_overheads()
    lazy = next(t.nbytes for t in packaged.terms if t.term == vm.FITTED_TERM)
    table = packaged.with_values(**{vm.FITTED_TERM: 0})
    sims = vm.simulate_configs(runs, gpu, table, vm.Traces(None))
    pred = vm.predict(runs, sims, gpu, table, lazy)
    measured = pred[~pred["real_oom"].astype(bool)]
    assert len(measured) >= 15
    assert measured["err"].abs().median() <= 0.05


def test_validation_under_the_measured_release(tmp_path):
    """Real measurements, the whole validation as the README runs it: HF models traced with
    transformers 4.49.0 (installed on the side from PyPI on first use), the fitted term
    fitted on FIT_MODELS only. The issue's bars: held-out median <= 5 %, every OOM verdict
    right; and the aim, all runs below xMem's own median error."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "pred.csv"
    root = Path(vm.__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "training.validate_memory", "--out", str(out)]
    assert subprocess.run(cmd, cwd=root, check=False).returncode == 0
    pred = pd.read_csv(out)
    assert len(pred) == 229
    assert (pred["pred_oom"] == pred["real_oom"]).all()
    measured = pred[~pred["real_oom"]]
    held_out = measured[~measured["model"].isin(vm.FIT_MODELS)]
    assert held_out["model"].nunique() == 4
    assert held_out["err"].median() <= 0.05
    assert measured["err"].median() < measured["xmem_error"].median()
