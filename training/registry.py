"""MLflow plumbing for the per-op model: tracking store, logging, registration, loading.

Default store: a SQLite file in the project (``sqlite:///<repo>/mlflow.db``) with artifacts
under ``<repo>/mlruns`` (both gitignored), so a training run needs no server; any tracking
URI (a server, another file) can be configured instead.

The model is logged as an MLflow pyfunc whose artifact is the plain model folder of
:class:`boom_ml.timing.heads.PerOpModel`, so ``mlflow.pyfunc.load_model(uri)`` serves
predictions and ``boom_ml`` can also unwrap it to the same object it loads from the package.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import pandas as pd

from boom_ml.timing.heads import PerOpModel

# Progress bars for local artifact copies only clutter training logs.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
REPO = Path(__file__).resolve().parent.parent
MODEL_ARTIFACT = "per_op"  # the name the model is logged under in a run


def default_tracking_uri() -> str:
    return f"sqlite:///{REPO / 'mlflow.db'}"


def setup(tracking_uri: str | None, experiment: str, artifact_location: str | None = None) -> str:
    """Point MLflow at the store and make sure ``experiment`` exists; returns its id."""
    uri = tracking_uri or default_tracking_uri()
    mlflow.set_tracking_uri(uri)
    found = mlflow.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    location = artifact_location
    if location is None and uri.startswith("sqlite:///"):
        # Keep artifacts beside the database file (the project's: <repo>/mlruns).
        db = Path(uri.removeprefix("sqlite:///"))
        location = (db.parent / "mlruns").resolve().as_uri()
    return mlflow.create_experiment(experiment, artifact_location=location)


class PerOpPyfunc(mlflow.pyfunc.PythonModel):
    """Pyfunc wrapper: input = canonical kernel rows with ``gpu_id``; output = predictions."""

    def __init__(self) -> None:
        self.model: PerOpModel | None = None

    def load_context(self, context: Any) -> None:
        self.model = PerOpModel.load(context.artifacts["model_dir"])

    def predict(self, context: Any, model_input: pd.DataFrame, params: Any = None) -> pd.DataFrame:
        from boom_ml.gpus import get_gpu

        assert self.model is not None
        specs = {g: get_gpu(g) for g in model_input["gpu_id"].astype(str).unique()}
        return self.model.predict_rows(model_input, specs)


def log_model(model: PerOpModel, registered_name: str | None = None) -> tuple[str, str | None]:
    """Log ``model`` into the active run (registering it when named).

    Returns the logged model's URI and, when registered, ``models:/<name>/<version>``.
    """
    # MLflow warns that a Python object is cloudpickled and that no signature was given; the
    # object is a tiny wrapper whose state is the artifact folder, so both are expected.
    logging.getLogger("mlflow.pyfunc").setLevel(logging.ERROR)
    logging.getLogger("mlflow.models.model").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        folder = model.save(Path(tmp) / "model")
        info = mlflow.pyfunc.log_model(
            name=MODEL_ARTIFACT,
            python_model=PerOpPyfunc(),
            artifacts={"model_dir": str(folder)},
            registered_model_name=registered_name,
            pip_requirements=["lightgbm", "pandas", "numpy"],
        )
    version = getattr(info, "registered_model_version", None)
    registered = f"models:/{registered_name}/{version}" if registered_name and version else None
    return info.model_uri, registered


def load_logged(uri: str) -> PerOpModel:
    """The PerOpModel behind an MLflow model URI (runs:/..., models:/name/version, ...)."""
    wrapped = mlflow.pyfunc.load_model(uri)
    model = wrapped.unwrap_python_model().model
    assert isinstance(model, PerOpModel)
    return model


def latest_version_uri(name: str) -> str | None:
    """``models:/<name>/<latest version>``, or None when nothing is registered."""
    client = mlflow.MlflowClient()
    versions = client.search_model_versions(f"name='{name}'")
    if not versions:
        return None
    latest = max(int(v.version) for v in versions)
    return f"models:/{name}/{latest}"
