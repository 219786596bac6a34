"""The layout search's profile caches are keyed by the code and models that made them: a
retrained per-op model, or a changed tracer, zoo or memory model, is never served the last
one's profiles."""

from __future__ import annotations


def test_time_profiles_are_keyed_by_the_timing_model(monkeypatch) -> None:
    """A retrained or swapped per-op model must not be served profiles timed by the last one."""
    from boom_ml.parallel import profile_keys

    profile_keys.timing_identity.cache_clear()
    packaged = profile_keys.timing_identity()
    monkeypatch.setenv("BOOM_PER_OP_MODEL", "/another/model")
    profile_keys.timing_identity.cache_clear()
    try:
        assert profile_keys.timing_identity() != packaged
    finally:
        profile_keys.timing_identity.cache_clear()


def test_memory_profiles_are_keyed_by_the_memory_code(monkeypatch, tmp_path) -> None:
    """A changed tracer, zoo or memory model must not be served profiles replayed by the last."""
    from boom_ml import trace_cache
    from boom_ml.parallel import profile_keys as profile

    for d in ("trace", "zoo", "memory", "parallel"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "a.py").write_text("x = 1\n")
    for name in ("profile.py", "memory_profile.py"):  # how it is traced, what it holds
        (tmp_path / "parallel" / name).write_text("x = 1\n")
    monkeypatch.setattr(profile, "_ROOT", tmp_path)
    monkeypatch.setattr(trace_cache, "_PACKAGE", tmp_path)
    monkeypatch.setattr(trace_cache, "_CODE_DIRS", (tmp_path / "trace", tmp_path / "zoo"))

    def identity() -> str:
        trace_cache.code_digest.cache_clear()
        profile.memory_identity.cache_clear()
        return profile.memory_identity()

    try:
        before = identity()
        (tmp_path / "trace" / "a.py").write_text("x = 2\n")
        assert identity() != before
        (tmp_path / "memory" / "a.py").write_text("x = 2\n")
        assert identity() != before
        changed = identity()
        (tmp_path / "parallel" / "profile.py").write_text("x = 2\n")
        assert identity() != changed
        changed = identity()
        (tmp_path / "parallel" / "memory_profile.py").write_text("x = 2\n")
        assert identity() != changed
    finally:
        trace_cache.code_digest.cache_clear()
        profile.memory_identity.cache_clear()
