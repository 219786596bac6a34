"""Whether an op runs in a checkpointed block's forward re-run inside backward.

``torch.utils.checkpoint`` (non-reentrant, the kind boom-ml applies) re-runs a block's
forward under a saved-tensor hook of its own, ``_recomputation_hook``, for exactly as long
as the re-run lasts: also when it stops early, once backward has the tensors it needs (it
raises, so the module hooks that would mark the end are not called), and also inside the
custom autograd functions it calls, whose forwards run with grad mode off (4-bit matmuls),
where grad mode alone would call the op backward.
"""

from __future__ import annotations

import torch

_RECOMPUTE_HOOK = "_recomputation_hook."  # qualname prefix of its pack hook


def recompute_key() -> tuple[int, int] | None:
    """Names the re-run in progress (its hook, the backward node that asked for it); None
    outside one."""
    if torch._C._current_graph_task_id() == -1:
        return None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None or not getattr(hooks[0], "__qualname__", "").startswith(_RECOMPUTE_HOOK):
        return None
    node = torch._C._current_autograd_node()
    return id(hooks[0]), -1 if node is None else node._sequence_nr()


def recomputing() -> bool:
    """True inside a re-run: under its hook, or (reentrant checkpoint) in the engine with
    grad mode on, which backward kernels never are."""
    if torch._C._current_graph_task_id() == -1:
        return False
    return torch.is_grad_enabled() or recompute_key() is not None
