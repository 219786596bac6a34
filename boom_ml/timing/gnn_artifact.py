"""The packaged GNN: its weights and manifest on disk, and the manifest's use-the-GNN rule.

Training (``training/train_gnn.py``) saves the model with a manifest that says which per-op
function it was trained on and, per cell (model family x AMP), whether cross-validation found
it better than the per-op sum; ``boom_ml/timing/estimate.py`` asks :func:`use_gnn_for`.

It also holds the calibrated p10/p90 of the step time per method (``training/intervals.py``),
and per model family and method where that family's CV rows span enough held-out GPUs: the
error scale differs by family (CNNs miss by more than transformers), so a family's own interval
is used when packaged (:func:`interval_for`), the method's pooled one otherwise.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from boom_ml.errors import ArtifactError
from boom_ml.timing.gnn_features import FEATURE_VERSION
from boom_ml.timing.gnn_inference import GnnWeights

if TYPE_CHECKING:
    from boom_ml.timing.gnn_model import GnnEnsemble, StepGNN

ARTIFACT_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "gnn"


def save_model(
    model: StepGNN | GnnEnsemble, manifest: dict[str, Any], directory: Path = ARTIFACT_DIR
) -> None:
    """The torch model (``model.pt``, for training and its tests), the same weights as numpy
    arrays (``model.npz``, what predictions run: ``gnn_inference``) and the manifest, stamped
    with the feature version the model reads."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"config": model.config, "state": model.state_dict()}, directory / "model.pt")
    weights_of(model).save(directory / "model.npz")
    manifest = {**manifest, "feature_version": FEATURE_VERSION}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    load_model.cache_clear()
    load_weights.cache_clear()


@functools.cache
def load_model(
    directory: Path = ARTIFACT_DIR,
) -> tuple[StepGNN | GnnEnsemble, dict[str, Any]] | None:
    """The packaged torch model and its manifest, or None when none is packaged."""
    if not (directory / "model.pt").exists():
        return None
    import torch

    from boom_ml.timing.gnn_model import build_model

    manifest = _manifest(directory)
    blob = torch.load(directory / "model.pt", weights_only=True)
    model = build_model(blob["config"])
    model.load_state_dict(blob["state"])
    return model.eval(), manifest


@functools.cache
def load_weights(directory: Path = ARTIFACT_DIR) -> tuple[GnnWeights, dict[str, Any]] | None:
    """The packaged model's numpy weights and its manifest, or None when none is packaged
    (what predictions run: no torch import)."""
    if not (directory / "model.npz").exists():
        return None
    manifest = _manifest(directory)
    return GnnWeights.load(directory / "model.npz"), manifest


def _manifest(directory: Path) -> dict[str, Any]:
    """The manifest, refused when its model reads other features than this code computes
    (a column more or less would be read as its neighbour)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    if manifest.get("feature_version") != FEATURE_VERSION:
        raise ArtifactError(
            f"{directory}: GNN feature version {manifest.get('feature_version')} != "
            f"{FEATURE_VERSION}; retrain it with python -m training.train_gnn"
        )
    return manifest


def weights_of(model: StepGNN | GnnEnsemble) -> GnnWeights:
    """The numpy weights of a torch model: one state dict per member of an ensemble."""
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    config = {k: v for k, v in model.config.items() if k != "members"}
    count = int(model.config.get("members", 0))
    if not count:
        return GnnWeights(config, (state,))
    members = tuple(
        {k.removeprefix(f"members.{i}."): v for k, v in state.items() if k.startswith(f"members.{i}.")}
        for i in range(count)
    )  # fmt: skip
    return GnnWeights(config, members)


def regime(family: str, amp: str | None) -> str:
    """The cell a CV verdict is kept per: model family x AMP or not ("cnn/amp", ...)."""
    return f"{family}/{'no-amp' if amp in (None, 'none') else 'amp'}"


def use_gnn_for(manifest: dict[str, Any], family: str, amp: str | None) -> bool:
    """Whether CV said the GNN beats the per-op sum in this cell ("other/*": unseen family)."""
    rule = manifest.get("use_gnn", {})
    return bool(rule.get(regime(family, amp), rule.get(regime("other", amp), False)))


def interval_for(
    manifest: dict[str, Any], method: str, family: str | None = None
) -> tuple[float, float] | None:
    """Calibrated (log p10, log p90) multipliers of the step estimate by ``method`` ("gnn" or
    "per-op"), fitted on held-out-GPU CV predictions (training/intervals.py): the family's own
    when the manifest has one for ``family`` (manifests before by_family have none), else the
    method's pooled one; None if absent."""
    interval = manifest.get("interval") or {}
    cal = (interval.get("by_family") or {}).get(family, {}).get(method) or interval.get(method)
    if not cal:
        return None
    return float(cal["log_p10"]), float(cal["log_p90"])
