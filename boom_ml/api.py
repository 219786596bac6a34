"""predict(): the one place where zoo → trace → {memory, timing} → result meet."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from boom_ml.estimates import GpuPrediction, Prediction
from boom_ml.gpus import parse_gpu_list
from boom_ml.gpus.spec import GpuSpec
from boom_ml.memory.estimate import estimate_memory
from boom_ml.report.advisor import advise
from boom_ml.report.figures import check_plot_dir, write_plots
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.timing.estimate import estimate_time
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.step import trace_step
from boom_ml.trace_cache import TraceCache
from boom_ml.zoo import build_model


class Session:
    """One model under study: traces cached per step configuration.

    Tracing dominates the cost of a prediction, and the advisor asks about several
    variants of the same step, so each distinct StepSpec is traced once.
    """

    def __init__(self, model: str, cache: bool = True) -> None:
        self.model = ModelSpec(model)
        # The model is built on the first cache miss (an unknown model fails there, before
        # any trace): a graph from the on-disk cache needs no model library at all.
        self._cache = TraceCache() if cache else None
        self._graphs: dict[StepSpec, OpGraph] = {}

    def graph(self, step: StepSpec) -> OpGraph:
        if step not in self._graphs:
            graph = self._cache.get(self.model, step) if self._cache is not None else None
            if graph is None:
                # trace_step materialises and may checkpoint the module: a fresh build each time
                graph = trace_step(build_model(self.model), step)
                if self._cache is not None:
                    self._cache.put(self.model, step, graph)
            self._graphs[step] = graph
        return self._graphs[step]

    def evaluate(
        self,
        step: StepSpec,
        gpus: list[GpuSpec],
        max_batch: bool = False,
        time_unless_oom: bool = False,
    ) -> list[GpuPrediction]:
        """Memory and time of ``step`` on each GPU; ``max_batch`` adds the batch search.

        With ``time_unless_oom`` the time is only predicted where the step fits (the
        advisor's candidates that do not fit need no time); elsewhere it is ``None``.
        """
        graph = self.graph(step)

        def trace_at(batch: int) -> OpGraph:
            return self.graph(replace(step, batch_size=batch))

        results = []
        for spec in gpus:
            memory = estimate_memory(graph, spec, max_batch=max_batch, trace_at=trace_at)
            skip_time = time_unless_oom and not memory.fits
            results.append(
                GpuPrediction(
                    gpu=spec.id,
                    name=spec.name,
                    memory=memory,
                    time=None if skip_time else estimate_time(graph, spec, tf32=step.tf32),
                    price_usd_per_hour=spec.price_usd_per_hour,
                )
            )
        return results


def predict(
    model: str,
    gpu: str | Sequence[str] = "a100-80gb-sxm",
    batch_size: int = 1,
    seq_len: int | None = None,
    image_size: int | None = None,
    optimizer: str = "adamw",
    amp: str = "none",
    checkpointing: str = "none",
    tf32: bool = False,
    advice: bool = True,
    plot: str | None = None,
    cache: bool = True,
) -> Prediction:
    """Predict memory and step time of one training step of ``model`` on each GPU in ``gpu``.

    ``gpu`` is an id, alias, YAML path, a list of those, or ``"all"``. With ``advice``,
    every GPU where the step does not fit gets the cheapest changes that make it fit.
    With ``plot``, PNG figures are written to that directory (``Prediction.plots``).
    With ``cache`` (default), traced steps are reused from and stored in the on-disk
    cache (:mod:`boom_ml.trace_cache`); ``cache=False`` traces afresh and stores nothing.
    """
    step = StepSpec(
        batch_size=batch_size,
        seq_len=seq_len,
        image_size=image_size,
        optimizer=optimizer,
        amp=amp,
        checkpointing=checkpointing,
        tf32=tf32,
    )
    gpus = parse_gpu_list(gpu)  # validate before the (slower) trace
    if plot is not None:
        check_plot_dir(plot)
    session = Session(model, cache=cache)
    results = session.evaluate(step, gpus, max_batch=True)
    graph = session.graph(step)
    resolved = StepSpec(**graph.meta["step"])
    advised = {}
    if advice:
        failing = [(s, r) for s, r in zip(gpus, results, strict=True) if not r.fits]
        advised = advise(resolved, failing, partial(session.evaluate, time_unless_oom=True))
    prediction = Prediction(
        model=session.model.text,
        batch_size=batch_size,
        step=graph.meta["step"],
        graph={
            "num_ops": graph.num_ops,
            "flops": graph.flops,
            "num_parameters": graph.meta["num_parameters"],
            "trace_seconds": graph.meta["trace_seconds"],
        },
        gpus=results,
        advice=advised,
    )
    if plot is not None:
        prediction.plots = [str(p) for p in write_plots(prediction, graph, gpus, plot)]
    return prediction
