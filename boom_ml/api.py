"""predict(): the one place where zoo → trace → {memory, timing} → result meet."""

from __future__ import annotations

from collections.abc import Sequence

from boom_ml.estimates import GpuPrediction, Prediction
from boom_ml.gpus import parse_gpu_list
from boom_ml.memory.estimate import estimate_memory
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.timing.estimate import estimate_time
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model


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
) -> Prediction:
    """Predict memory and step time of one training step of ``model`` on each GPU in ``gpu``.

    ``gpu`` is an id, alias, YAML path, a list of those, or ``"all"``.
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
    built = build_model(ModelSpec(model))
    graph = trace_step(built, step)
    results = [
        GpuPrediction(
            gpu=spec.id,
            name=spec.name,
            memory=estimate_memory(graph, spec),
            time=estimate_time(graph, spec, tf32=tf32),
            price_usd_per_hour=spec.price_usd_per_hour,
        )
        for spec in gpus
    ]
    return Prediction(
        model=built.spec.text,
        batch_size=batch_size,
        step=graph.meta["step"],
        graph={
            "num_ops": graph.num_ops,
            "flops": graph.flops,
            "num_parameters": graph.meta["num_parameters"],
            "trace_seconds": graph.meta["trace_seconds"],
        },
        gpus=results,
    )
