"""Which torchvision models trace: every classification, segmentation and video model.

Run: python benchmarks/torchvision_models.py [--models resnet50,r3d_18 ...]

Each model is predicted once on an A100-80GB at batch 2 with its default sizes (the size its
weights record; 16 frames for video unless its weights say otherwise), no advice, no max-batch
search, no cache, in this process. Detection and optical-flow models are listed apart: they
stop with one line by design. Prints one row per model: ``ok`` with its step time, or the
one-line error, and seconds (wall clock, this machine).
"""

from __future__ import annotations

import argparse
import time


def families() -> dict[str, list[str]]:
    import torchvision
    from torchvision import models

    listed = {
        "classification": models.list_models(module=models),
        "segmentation": models.list_models(module=models.segmentation),
        "video": models.list_models(module=models.video),
        "not supported": models.list_models(module=models.detection)
        + models.list_models(module=models.optical_flow),
    }
    print(f"torchvision {torchvision.__version__}: "
          + ", ".join(f"{len(v)} {k}" for k, v in listed.items()))  # fmt: skip
    return listed


def run(name: str) -> tuple[str, float]:
    """``ok`` (and the step's ms) or the one-line error, and the seconds it took."""
    import boom_ml
    from boom_ml.errors import BoomError

    started = time.perf_counter()
    try:
        pred = boom_ml.predict(model=f"torchvision:{name}", gpu="a100-80gb-pcie", batch_size=2,
                               advice=False, max_batch="off", cache=False)  # fmt: skip
        result = f"ok {pred.gpus[0].time.step_ms:.1f} ms"
    except BoomError as err:
        result = f"error: {err}"
    except Exception as err:  # noqa: BLE001 - a bug: say which model and go on
        result = f"FAILED ({type(err).__name__}): {' '.join(str(err).split())[:160]}"
    return result, time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", help="comma-separated torchvision names (default: all)")
    args = ap.parse_args(argv)
    listed = families()
    wanted = set(args.models.split(",")) if args.models else None
    counts: dict[str, int] = {}
    for family, names in listed.items():
        for name in names:
            if wanted is not None and name not in wanted:
                continue
            result, seconds = run(name)
            kind = result.split(" ", 1)[0].rstrip(":")
            counts[f"{family} {kind}"] = counts.get(f"{family} {kind}", 0) + 1
            print(f"{family:15s} {name:40s} {seconds:5.1f} s  {result}", flush=True)
    print("; ".join(f"{k}: {n}" for k, n in counts.items()))


if __name__ == "__main__":
    main()
