"""Run a module against another transformers release, without touching the environment.

The memory validation has to trace the Hugging Face models with the model and loss code
that was measured, whatever release the user has installed: the HF models' allocations
follow that code (transformers <= 4.48 copies the shifted logits for the causal-LM loss,
4.49 pads the labels instead; 5.x differs again). ``pip install --no-deps --target`` puts
the wanted release, with the tokenizers and huggingface-hub releases it requires, into a
cache folder once; the module then runs again in a child process with that folder first
on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# transformers release -> the dependency pins its import-time version check accepts.
RELEASES: dict[str, tuple[str, ...]] = {
    "4.49.0": ("tokenizers==0.21.0", "huggingface-hub==0.26.5"),
    "4.39.3": ("tokenizers==0.15.2", "huggingface-hub==0.23.4"),
}
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "boom_ml"
CHILD_FLAG = "BOOM_ML_SIDE_RELEASE"  # set in the child: it must not re-run itself


def installed_release() -> str:
    """The transformers release this interpreter imports."""
    import transformers  # slow to import; only the HF paths need it

    return transformers.__version__


def release_dir(version: str) -> Path:
    return CACHE_ROOT / f"transformers-{version}"


def ensure_release(version: str) -> Path:
    """The folder holding ``version`` (installed from PyPI on first use)."""
    if version not in RELEASES:
        known = ", ".join(sorted(RELEASES))
        raise SystemExit(f"transformers {version}: no dependency pins known (known: {known})")
    target = release_dir(version)
    if (target / "transformers" / "__init__.py").exists():
        return target
    print(f"installing transformers {version} into {target} (once, from PyPI) ...", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
           f"transformers=={version}", *RELEASES[version]]  # fmt: skip
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        raise SystemExit(f"could not install transformers {version} ({' '.join(cmd)})")
    return target


def rerun_with(version: str, module: str, argv: list[str]) -> int:
    """Run ``python -m module argv`` with transformers ``version``; its exit status."""
    if os.environ.get(CHILD_FLAG):
        raise SystemExit(
            f"transformers {version} was put first on PYTHONPATH but {installed_release()} "
            "was imported"
        )
    target = ensure_release(version)
    paths = [str(target), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), CHILD_FLAG: "1"}
    root = Path(__file__).resolve().parent.parent  # where ``-m training...`` resolves
    cmd = [sys.executable, "-m", module, *argv]
    return subprocess.run(cmd, env=env, cwd=root, check=False).returncode
