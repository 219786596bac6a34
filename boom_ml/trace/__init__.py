"""Trace one training step on fake tensors into an OpGraph."""

# Bump when a change to the tracer changes the graphs it produces: caches of traced
# graphs (training/validate_memory.py, training/graph_dataset.py) key on it.
TRACE_VERSION = 5
