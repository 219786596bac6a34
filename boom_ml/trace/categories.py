"""Give every allocation event a memory category, once the whole step has been seen.

Whether a forward tensor is an *activation* (kept for backward) or a *temporary* depends
on when it dies, so categories are assigned after recording, from the event list.
"""

from __future__ import annotations

from typing import Any

from boom_ml.trace.recorder import OpRecorder

FORWARD_PHASES = {"forward", "loss", "recompute", "autocast_exit"}
FIXED = {
    "parameter": "parameter",
    "gradient": "gradient",
    "optimizer_state": "optimizer_state",
    "host": "host",
    "input": "input",
}


def assign_categories(
    recorder: OpRecorder, grad_blocks: set[int], state_blocks: set[int]
) -> list[dict[str, Any]]:
    """Return the recorder's events with ``category`` filled; host tensors are dropped."""
    freed_in = {e["block"]: e["phase"] for e in recorder.events if e["action"] == "free"}
    category: dict[int, str] = {}
    for block, phase in recorder.block_phase.items():
        if phase in FIXED:
            category[block] = FIXED[phase]
        elif block in grad_blocks:
            category[block] = "gradient"
        elif block in state_blocks:
            category[block] = "optimizer_state"
        elif block in recorder.autocast_blocks:
            category[block] = "autocast_copy"
        elif phase in FORWARD_PHASES and freed_in.get(block) not in FORWARD_PHASES:
            category[block] = "activation"
        else:
            category[block] = "temporary"
    events = []
    for e in recorder.events:
        cat = category[e["block"]]
        if cat != "host":
            events.append({**e, "seq": len(events), "category": cat})
    return events
