"""Settings shared by every test."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Tests (and the processes they start, which inherit the environment) keep traced graphs in
# a cache of their own: never the user's ~/.cache/boom_ml, never graphs from earlier runs;
# removed when the run ends, so runs leave no directories behind in the temp folder.
_CACHE = tempfile.mkdtemp(prefix="boom-test-cache-")
os.environ["BOOM_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# Traces run in the test's own process (the CLI would start workers beside them); the pool's
# tests (test_trace_pool.py) set their own count.
os.environ["BOOM_TRACE_WORKERS"] = "0"
