"""Trace one training step on fake tensors into an OpGraph."""

import os

# Bump when a change to the tracer changes the graphs it produces: the memory validation's
# trace cache (training/validate_memory.py) keys on it; training/step_traces.py instead
# counts cached graphs made by other tracer code as stale.
# 7: the optimizer implementation follows the stack (Adafactor: for-loop)
# 8: recipes of issue #15 (params_dtype, LoRA/QLoRA, 8-bit optimizers, selective checkpointing)
# 9: SDPA follows the target GPU's attention architecture group (StepSpec.sdpa_group);
#    native GQA in the fused kernels; causal attention FLOPs count the kept pairs only
# 10: a grouped convolution's weight gradient counts its own FLOPs (torch's formula counted
#     groups=1: a depthwise one C times over)
# 11: meta["gradients"]: the gradients' sizes per dtype (gradient accumulation's adds)
TRACE_VERSION = 11

# ``$BOOM_REPEAT_LAYERS=0``: trace deep models whole, never one layer repeated (trace/repeat.py);
# torch-free here because the trace cache keys on it
REPEAT_ENV = "BOOM_REPEAT_LAYERS"


def repeat_enabled() -> bool:
    return os.environ.get(REPEAT_ENV, "1").strip().lower() not in ("0", "false", "off", "no")
