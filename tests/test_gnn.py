"""GNN step-time model: attributions, the trace cache, and one epoch on real measurements."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from boom_ml.gpus import get_gpu
from boom_ml.specs import StepSpec
from boom_ml.timing import estimate, gnn_artifact, gnn_features, gnn_inference, gnn_model
from boom_ml.trace.step import trace_step
from data_collection.paths import shared_data_dir
from tests.tiny_models import tiny_cnn
from training.train_gnn import CONFIG_DIR

SHARED = shared_data_dir()


def _perturbed_model(seed: int = 0) -> gnn_model.StepGNN:
    """A model whose corrections and overhead are non-zero (a fresh one starts at per-op)."""
    torch.manual_seed(seed)
    model = gnn_model.StepGNN(hidden=16, layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def test_attributions_sum_to_predicted_step_time(monkeypatch) -> None:
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="adamw"))
    gpu = get_gpu("a100-80gb-sxm")
    model = _perturbed_model()
    per_op = gnn_features.per_op_function(None)[0]  # the heads when packaged, else the roofline
    # strict fp32: with TF32 allowed, the step may be the strict one (estimate.py), not pred
    pred = gnn_model.predict_graph(model, graph, gpu, tf32=False, per_op=per_op)
    assert pred.overhead_ms > 0 and (pred.node_ms >= 0).all()
    assert pred.step_ms == pytest.approx(pred.overhead_ms + pred.node_ms.sum(), rel=1e-12)
    host = graph.nodes["family"].eq("host").to_numpy()
    assert (pred.node_ms[host] == 0).all()

    manifest = {"per_op": per_op, "use_gnn": {"cnn/no-amp": True}}
    monkeypatch.setattr(
        estimate, "load_weights", lambda: (gnn_artifact.weights_of(model), manifest)
    )
    # this GPU's own estimate (the perturbed GNN can time it slower than a GPU it dominates)
    est = estimate.estimate_time(graph, gpu, tf32=False, top_n=1000, dominance=False)
    assert est.method == "gnn"
    assert est.step_ms == pytest.approx(pred.step_ms, rel=1e-6)
    attributed = est.step_ms - est.overhead_ms
    # Every node is in exactly one family, one module and one (op, phase): all three
    # partitions add up to the step time minus the overhead (up to 4-decimal rounding).
    tol = 1e-4 * (len(graph.nodes) + 1)
    assert sum(est.by_family.values()) == pytest.approx(attributed, abs=tol)
    assert sum(m["ms"] for m in est.top_modules) == pytest.approx(attributed, abs=tol)
    assert sum(o["ms"] for o in est.top_ops) == pytest.approx(attributed, abs=tol)


def test_the_numpy_pass_is_the_torch_model() -> None:
    """Predictions run the packaged weights in numpy (no torch import): the torch model's
    node times, overhead and clamped columns, on the packaged model and GPUs inside and
    beyond its training range, in fp32 and AMP, and on a perturbed model with larger
    corrections."""
    packaged = gnn_artifact.load_model()
    assert packaged is not None
    model, manifest = packaged
    weights, numpy_manifest = gnn_artifact.load_weights()
    assert numpy_manifest == manifest
    gpus = [get_gpu(g) for g in ("t4", "a100-80gb-sxm", "b200", "l40")]
    per_op = manifest["per_op"]
    for amp in ("none", "bf16"):
        graph = trace_step(
            tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="adamw", amp=amp)
        )
        for torch_model, numpy_weights in (
            (model, weights),
            (_perturbed_model(2), gnn_artifact.weights_of(_perturbed_model(2))),
        ):
            theirs = gnn_model.predict_graph_many(torch_model, graph, gpus, None, per_op)
            ours = gnn_inference.predict_graph_many(numpy_weights, graph, gpus, None, per_op)
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_allclose(a.node_ms, b.node_ms, rtol=2e-5, atol=1e-9)
                assert a.overhead_ms == pytest.approx(b.overhead_ms, rel=2e-5)
                assert a.clamped == b.clamped
            if numpy_weights is weights:  # the B200 is beyond the training GPUs: named
                assert ours[2].clamped and not ours[0].clamped


def test_many_gpus_in_one_pass_equal_one_gpu_at_a_time(monkeypatch) -> None:
    """The batched path (one message pass, rows of several GPUs; built without PyG) gives
    each GPU the numbers of its own call, GNN and per-op alike, a GPU listed twice included."""
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="adamw"))
    gpus = [get_gpu(g) for g in ("a100-80gb-sxm", "l4", "t4", "l4")]
    model = _perturbed_model(1)
    per_op = gnn_features.per_op_function(None)[0]
    many = gnn_model.predict_graph_many(model, graph, gpus, tf32=None, per_op=per_op)
    for gpu, pred in zip(gpus, many, strict=True):
        one = gnn_model.predict_graph(model, graph, gpu, tf32=None, per_op=per_op)
        np.testing.assert_allclose(pred.node_ms, one.node_ms, rtol=1e-5)
        assert pred.overhead_ms == pytest.approx(one.overhead_ms, rel=1e-5)
    # The one-graph batch is PyG's collate of that graph, field by field.
    _, fn = gnn_features.per_op_function(per_op)
    rows = [
        gnn_features.row_inputs(graph, g, None, np.asarray(fn(graph.nodes, g, None))) for g in gpus
    ]
    ours = gnn_features.one_graph_batch(graph, rows)
    pyg = gnn_features.collate([gnn_features.graph_data(graph)], [0] * len(rows), rows)
    for name in ("node_of", "row_of", "dynamic", "log_per_op", "context", "row_start"):
        assert torch.equal(getattr(ours, name), getattr(pyg, name)), name
    for field in ("x", "gpu_mask", "batch"):
        assert torch.equal(getattr(ours.graphs, field), getattr(pyg.graphs, field)), field
    for a, b in zip(ours.adjacency, pyg.adjacency, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    weights = gnn_artifact.weights_of(model)
    for use_gnn in (True, False):
        manifest = {"per_op": per_op, "use_gnn": {"cnn/no-amp": use_gnn}}
        monkeypatch.setattr(estimate, "load_weights", lambda m=manifest: (weights, m))
        batched = estimate.estimate_times(graph, gpus)
        for gpu, est in zip(gpus, batched, strict=True):
            alone = estimate.estimate_time(graph, gpu)
            assert est.method == alone.method == ("gnn" if use_gnn else "per-op")
            # a top op's time is the GNN's where it timed the step, on the per-op model's
            methods = {o["method"] for o in est.top_ops}
            assert methods and all(m.startswith("gnn over ") == use_gnn for m in methods)
            for key in ("step_ms", "p10_ms", "p90_ms"):
                assert getattr(est, key) == pytest.approx(getattr(alone, key), rel=1e-5), key
    assert estimate.estimate_times(graph, []) == []


def test_per_op_fallback_where_cv_says_so(monkeypatch) -> None:
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, image_size=16, optimizer="none"))
    manifest = {
        "per_op": gnn_features.per_op_function(None)[0],
        "use_gnn": {"cnn/no-amp": False, "other/no-amp": True},
    }
    monkeypatch.setattr(
        estimate, "load_weights", lambda: (gnn_artifact.weights_of(_perturbed_model()), manifest)
    )
    est = estimate.estimate_time(graph, get_gpu("l4"))
    assert est.method != "gnn" and est.overhead_ms == 0.0


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared data dir {SHARED} is absent")
def test_trains_one_epoch_on_real_rows(tmp_path, monkeypatch, capsys) -> None:
    """Real cnn_step_times rows of two small models: dataset, one-epoch CV, package."""
    from data_collection.import_public import import_all
    from training import intervals
    from training.train_gnn import run

    import_all(SHARED, tmp_path / "canonical", only=["cnn_step_times"], progress=False)
    monkeypatch.setenv("BOOM_DATA_DIR", str(tmp_path / "canonical"))
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose("train_gnn", overrides=[
            "data.models=[torchvision:squeezenet1_1,torchvision:resnet18]",
            f"data.cache_dir={tmp_path / 'cache'}", "per_op=roofline", "train.epochs=1",
            "model.hidden=16", "model.layers=2", "train.members=2", "cv.families=false",
            "mlflow.enabled=false",
            f"artifact_dir={tmp_path / 'artifact'}", "threads=1",
        ])  # fmt: skip
    manifest = run(cfg)
    assert manifest["data"]["rows"] > 10 and manifest["per_op"] == "roofline"
    assert any("float64" in k for k in manifest["data"]["excluded"])
    held = {line["held out"] for line in manifest["cv"]}
    assert {"gpu=titan-xp", "gpu=all (pooled)"} <= held
    assert all(np.isfinite(line["GNN MAPE %"]) for line in manifest["cv"])
    model, saved = gnn_artifact.load_model(tmp_path / "artifact")
    assert saved["use_gnn"] == manifest["use_gnn"]
    # the interval's level chosen by leave-one-GPU-out among the folds, its quantiles recorded
    level = saved["interval"]["per-op"]["level"]
    assert level in intervals.LEVEL_GRID
    assert saved["interval"]["levels"] == list(intervals.quantile_levels(level))
    assert isinstance(model, gnn_model.GnnEnsemble) and len(model.members) == 2
    config = model.members[0].config
    assert {k: config[k] for k in ("hidden", "layers", "max_log_correction")} == {
        "hidden": 16, "layers": 2, "max_log_correction": 4.0}  # fmt: skip
    # Spec columns clamped to the training GPUs' range: column 4 is SMs / 100, from the
    # GTX 1080 Ti's 28 to the A100-SXM's 108 among these rows' GPUs.
    low, high = config["spec_range"]
    assert (low[4], high[4]) == pytest.approx((0.28, 1.08), rel=1e-6)
    # The per-run table (training/run_bias.py) names the runs of the held-out GPUs.
    printed = capsys.readouterr().out.split("Held-out predictions per measuring run", 1)[1]
    assert "script2018" in printed and "TITANXP" in printed and "titan-xp" in printed


def test_ensemble_is_the_members_mean_and_round_trips(tmp_path) -> None:
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="sgd"))
    gpus = [get_gpu("a100-80gb-sxm"), get_gpu("t4")]
    members = [_perturbed_model(seed) for seed in (1, 2, 3)]
    ensemble = gnn_model.GnnEnsemble(members).eval()
    assert ensemble.config == {"hidden": 16, "layers": 2, "max_log_correction": 4.0, "members": 3}
    per_op = gnn_features.per_op_function(None)[0]
    alone = [gnn_model.predict_graph_many(m, graph, gpus, None, per_op) for m in members]
    preds = gnn_model.predict_graph_many(ensemble, graph, gpus, None, per_op)
    for k, pred in enumerate(preds):
        steps = [a[k].step_ms for a in alone]
        assert pred.step_ms == pytest.approx(np.mean(steps), rel=1e-6)
        assert min(steps) < pred.step_ms < max(steps)  # the members differ: a real mean
        assert pred.step_ms == pytest.approx(pred.overhead_ms + pred.node_ms.sum(), rel=1e-9)
        nodes = np.mean([a[k].node_ms for a in alone], axis=0)
        np.testing.assert_allclose(pred.node_ms, nodes, rtol=1e-5)
    gnn_artifact.save_model(ensemble, {"per_op": per_op}, tmp_path)
    loaded, _ = gnn_artifact.load_model(tmp_path)
    again = gnn_model.predict_graph_many(loaded, graph, gpus, None, per_op)
    assert [p.step_ms for p in again] == [p.step_ms for p in preds]
    # what predictions run: the numpy pass over the saved arrays, the members' mean too
    weights, _ = gnn_artifact.load_weights(tmp_path)
    assert len(weights.members) == 3
    numpy_preds = gnn_inference.predict_graph_many(weights, graph, gpus, None, per_op)
    for ours, theirs in zip(numpy_preds, preds, strict=True):
        np.testing.assert_allclose(ours.node_ms, theirs.node_ms, rtol=1e-5, atol=1e-9)
        assert ours.overhead_ms == pytest.approx(theirs.overhead_ms, rel=1e-5)


def test_gnn_not_used_when_trained_on_another_per_op_function(monkeypatch) -> None:
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, image_size=16, optimizer="none"))
    monkeypatch.setattr(estimate, "per_op_function", lambda name=None: ("per-op", None))
    manifest = {"per_op": "roofline", "use_gnn": {"cnn/no-amp": True}}
    monkeypatch.setattr(
        estimate, "load_weights", lambda: (gnn_artifact.weights_of(_perturbed_model()), manifest)
    )
    assert estimate.estimate_time(graph, get_gpu("l4")).method != "gnn"  # its CV verdict is void


def test_batched_per_op_times_equal_per_gpu_calls() -> None:
    """The dataset featurises a graph for all its GPUs at once: same numbers as one by one."""
    from boom_ml.timing.heads import load_model
    from boom_ml.timing.per_op import node_ms_many, predict_nodes

    graph = trace_step(tiny_cnn(), StepSpec(batch_size=2, image_size=16, optimizer="adamw"))
    gpus = [get_gpu(g) for g in ("t4", "a100-80gb-pcie", "l4", "t4")]
    heads = load_model()
    many = node_ms_many(graph.nodes, gpus, None, heads)
    for k, gpu in enumerate(gpus):
        one = predict_nodes(graph.nodes, gpu, None, heads)["ms"].to_numpy()
        np.testing.assert_array_equal(many[k], one)
    fn = gnn_features.heads_function(heads)
    np.testing.assert_array_equal(fn(graph.nodes, gpus[1], None), many[1])


def test_gnn_replaces_the_per_op_sum_only_where_it_is_significantly_better() -> None:
    from training.gnn_decision import decide

    n = 40
    target = np.full(n, 100.0)
    miss = np.linspace(0.01, 0.20, n)  # the per-op sum's relative errors on one cell
    swapped = miss[::-1].copy()
    swapped[0] -= 0.001  # the same errors on other rows, one a hair smaller
    synthetic = pd.DataFrame({  # synthetic CV predictions of two cells, 40 held-out rows each
        "kind": "gpu", "held_out": "x", "target_ms": np.r_[target, target],
        "family": ["cnn"] * n + ["transformer"] * n, "amp": "none",
        # cnn: the GNN misses by 5 % where the per-op sum misses by 30 %
        "baseline_ms": np.r_[np.full(n, 130.0), target * (1 + miss)],
        "gnn_ms": np.r_[np.full(n, 105.0), target * (1 + swapped)],
    })  # fmt: skip
    synthetic["cell"] = [
        gnn_artifact.regime(f, a)
        for f, a in zip(synthetic["family"], synthetic["amp"], strict=True)
    ]
    use, table = decide(synthetic)
    rows = table.set_index("cell")
    assert use["cnn/no-amp"] is True and rows.loc["cnn/no-amp", "p (GNN better)"] < 1e-6
    assert swapped.mean() < miss.mean()  # the GNN's MAPE is the lower one
    assert use["transformer/no-amp"] is False  # no better beyond chance
    assert rows.loc["transformer/no-amp", "p (GNN better)"] > 0.3


def test_spec_context_off_hides_the_spec_sheet_and_round_trips(tmp_path) -> None:
    """``model.spec_context=false``: changing the GPU's spec columns of the context changes
    nothing; the step columns still count; the saved config rebuilds the same model."""
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="sgd"))
    gpu = get_gpu("t4")
    per_op = np.full(len(graph.nodes), 0.05)
    batch = gnn_features.one_graph_batch(graph, [gnn_features.row_inputs(graph, gpu, None, per_op)])
    other = dataclasses.replace(batch, context=batch.context.clone())
    other.context[:, : gnn_features.N_SPEC] += 1.0
    step_changed = dataclasses.replace(batch, context=batch.context.clone())
    step_changed.context[:, gnn_features.N_SPEC :] += 1.0
    torch.manual_seed(0)
    hidden = gnn_model.StepGNN(hidden=16, layers=2, spec_context=False)
    seen = gnn_model.StepGNN(hidden=16, layers=2)
    with torch.no_grad():
        for p_hidden, p_seen in zip(hidden.parameters(), seen.parameters(), strict=True):
            p_hidden.add_(torch.randn_like(p_hidden) * 0.3)
            p_seen.copy_(p_hidden)
        step = hidden(batch)[2]
        assert torch.equal(hidden(other)[2], step)
        assert not torch.equal(hidden(step_changed)[2], step)
        assert not torch.equal(seen(other)[2], seen(batch)[2])
    assert hidden.config["spec_context"] is False and "spec_context" not in seen.config
    gnn_artifact.save_model(hidden, {"per_op": "roofline"}, tmp_path)
    loaded, _ = gnn_artifact.load_model(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(other)[2], step)


def test_spec_range_reads_a_gpu_beyond_it_as_its_edge(tmp_path) -> None:
    """With ``spec_range``, a context beyond the training GPUs' spec columns predicts what
    the range's edge does; inside the range the clamp changes nothing; the range round-trips."""
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="sgd"))
    per_op = np.full(len(graph.nodes), 0.05)
    batch = gnn_features.one_graph_batch(
        graph, [gnn_features.row_inputs(graph, get_gpu("t4"), None, per_op)]
    )
    spec = batch.context[0, : gnn_features.N_SPEC]
    free = _perturbed_model()
    clamped = gnn_model.StepGNN(
        hidden=16, layers=2, spec_range=[(spec - 0.5).tolist(), (spec + 0.5).tolist()]
    )
    clamped.load_state_dict(free.state_dict())
    clamped.eval()

    def shifted(by: float) -> gnn_features.RowBatch:
        out = dataclasses.replace(batch, context=batch.context.clone())
        out.context[:, : gnn_features.N_SPEC] += by
        return out

    with torch.no_grad():
        assert torch.equal(clamped(shifted(0.3))[2], free(shifted(0.3))[2])
        assert torch.equal(clamped(shifted(2.0))[2], free(shifted(0.5))[2])
        assert torch.equal(clamped(shifted(-2.0))[2], free(shifted(-0.5))[2])
        assert not torch.equal(free(shifted(2.0))[2], free(shifted(0.5))[2])
    gnn_artifact.save_model(clamped, {"per_op": "roofline"}, tmp_path)
    loaded, _ = gnn_artifact.load_model(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(shifted(2.0))[2], free(shifted(0.5))[2])


def test_gpus_beyond_the_spec_range_are_named_in_explain(monkeypatch) -> None:
    """A model trained on T4 rows alone reads an H100's spec sheet at the T4's values: the
    prediction names the columns it clamped, and explain=true says so; the T4 has none."""
    from boom_ml.estimates import GpuPrediction, MemoryEstimate
    from boom_ml.report.explain import explain_lines

    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="sgd"))
    t4, h100 = get_gpu("t4"), get_gpu("h100-sxm")
    context = gnn_features.gpu_context(graph, t4, None, np.full(len(graph.nodes), 0.05))
    spec = torch.from_numpy(context[: gnn_features.N_SPEC])
    model = gnn_model.StepGNN(hidden=16, layers=2, spec_range=[spec.tolist(), spec.tolist()])
    model.load_state_dict(_perturbed_model().state_dict())
    model.eval()
    per_op = gnn_features.per_op_function(None)[0]  # the heads when packaged, else the roofline
    on_t4, on_h100 = gnn_model.predict_graph_many(model, graph, [t4, h100], None, per_op)
    assert on_t4.clamped == []
    # the H100 SXM: more SMs (132 vs 40), bandwidth, peaks, L2, clock and memory than a T4
    assert set(on_h100.clamped) >= {"SMs", "memory bandwidth", "matrix peak", "L2 cache"}
    monkeypatch.setattr(
        estimate,
        "load_weights",
        lambda: (
            gnn_artifact.weights_of(model),
            {"per_op": per_op, "use_gnn": {"cnn/no-amp": True}},
        ),
    )
    est = estimate.estimate_time(graph, h100)
    assert est.gnn_clamped == on_h100.clamped
    memory = MemoryEstimate(
        peak_allocated_bytes=1,
        peak_reserved_bytes=1,
        total_bytes=1,
        capacity_bytes=2,
        fits=True,
        method="test",
    )
    text = "\n".join(explain_lines(GpuPrediction("h100-sxm", "H100", memory, est)))
    assert "the GNN read this GPU's FP32 TFLOPS, matrix peak, memory bandwidth" in text


def test_a_gpu_without_an_l2_figure_reads_its_architectures_median() -> None:
    """The A30 has no L2 figure in the GPU table: the GNN reads the median L2 of the Ampere
    GPUs that give one, as the per-op features do (read as 0 and clamped, a missing figure
    made an L40 9 % faster than itself with its 96 MB), and does not name the flag as read at
    an edge; a model that does not read the spec columns (spec_context=false) names none."""
    from boom_ml.timing.spec_sheet import spec_medians

    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="sgd"))
    t4, a30 = get_gpu("t4"), get_gpu("a30")
    assert a30.l2_cache_mb is None
    per_op = np.full(len(graph.nodes), 0.05)
    l2 = gnn_features.SPEC_NAMES.index("L2 cache")
    context = gnn_features.gpu_context(graph, a30, None, per_op)
    assert context[l2] == pytest.approx(spec_medians("ampere")["l2_cache_mb"] / 40)
    assert context[l2 + 1] == 1.0  # the flag still says the figure was missing
    spec = gnn_features.gpu_context(graph, t4, None, per_op)[: gnn_features.N_SPEC]
    contexts = torch.stack([torch.from_numpy(gnn_features.gpu_context(graph, g, None, per_op))
                            for g in (t4, a30)])  # fmt: skip
    low, high = spec - 10, spec + 10  # every figure inside; the flag 0, as in training
    low[l2 + 1] = high[l2 + 1] = 0.0
    seen = gnn_model.StepGNN(hidden=16, layers=2, spec_range=[low.tolist(), high.tolist()])
    assert seen.beyond_range(contexts) == [[], []]
    blind = gnn_model.StepGNN(
        hidden=16, layers=2, spec_context=False, spec_range=[spec.tolist()] * 2
    )
    assert blind.beyond_range(contexts + 5) == [[], []]


def test_a_gpus_memory_size_does_not_change_the_gnn_time() -> None:
    """The memory size was a spec column: an A100-80GB cut to 8 GB predicted resnet18's step
    1.5 ms faster (a step that fits takes the same time whatever the capacity; the column let
    the GNN tell training GPUs apart by it). The GPU's context and the GNN's time are now the
    same for both sizes, and a manifest of a model that read it is refused."""
    graph = trace_step(tiny_cnn(), StepSpec(batch_size=4, image_size=32, optimizer="sgd"))
    a100 = get_gpu("a100-80gb-sxm")
    small = dataclasses.replace(
        a100, memory_gb=8.0, memory_bytes=8 * 2**30, total_memory_bytes=None
    )
    per_op = np.full(len(graph.nodes), 0.05)
    assert np.array_equal(gnn_features.gpu_context(graph, a100, None, per_op),
                          gnn_features.gpu_context(graph, small, None, per_op))  # fmt: skip
    assert "memory size" not in gnn_features.SPEC_NAMES
    model = _perturbed_model()
    big_t, small_t = gnn_model.predict_graph_many(model, graph, [a100, small], None, "roofline")
    assert big_t.step_ms == small_t.step_ms


def test_a_gnn_packaged_for_other_features_is_refused(tmp_path) -> None:
    """A model saved before the memory size left its spec columns reads one column more; its
    manifest's feature version says so, and loading it names the command that retrains it."""
    from boom_ml.errors import ArtifactError

    gnn_artifact.save_model(_perturbed_model(), {"per_op": "roofline"}, tmp_path)
    assert gnn_artifact.load_weights(tmp_path) is not None  # stamped with this version
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text().replace(
        f'"feature_version": {gnn_features.FEATURE_VERSION}', '"feature_version": 1'))  # fmt: skip
    gnn_artifact.load_weights.cache_clear()
    with pytest.raises(
        ArtifactError, match="feature version 1 != 2; retrain it with python -m training.train_gnn"
    ):
        gnn_artifact.load_weights(tmp_path)


def test_the_time_figure_has_a_bar_for_the_gnn_overhead() -> None:
    """plot= drew the families only: 3.9 ms of a 9.1 ms GNN step (its overhead) was nowhere."""
    from boom_ml.estimates import TimeEstimate
    from boom_ml.report.time_plots import family_bars

    t = TimeEstimate(step_ms=9.0, method="gnn", by_family={"gemm": 4.0, "elementwise": 1.0},
                     overhead_ms=4.0)  # fmt: skip
    assert family_bars(t) == [("gemm", 4.0), ("elementwise", 1.0), ("GNN overhead (no op)", 4.0)]
    assert family_bars(t, grad_accum=2)[-1] == ("GNN overhead (no op)", 2.0)
    assert family_bars(TimeEstimate(step_ms=5.0, method="per-op", by_family={"gemm": 5.0})) == [
        ("gemm", 5.0)]  # fmt: skip
