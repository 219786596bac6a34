"""``hf:<org>/<name>`` beyond the shipped configs: local HF cache, offline errors, downloads.

Never touches the network: the cache is a folder built here, ``HF_HUB_OFFLINE=1`` where the
offline path is tested, and the download function is replaced where the online path is.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import tiny_llama_config

from boom_ml.errors import InvalidInputError, UnknownModelError
from boom_ml.zoo import build_model, hf_hub

# A synthetic tiny Llama: 2 layers, hidden 64, vocab 128 (not a published model).
TINY_LLAMA = tiny_llama_config(vocab_size=128, tie_word_embeddings=False)
# embed 128*64 + 2 layers * (q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*128 + 2 norms 64)
# + final norm 64 + lm_head 64*128
TINY_LLAMA_PARAMS = (
    128 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64 + 64 * 128
)


def _populate_cache(cache: Path, repo_id: str, config: dict) -> Path:
    """The hub cache layout: models--org--name/{refs/main, snapshots/<rev>/config.json}."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_from_local_cache_offline(offline_cache: Path) -> None:
    cached = _populate_cache(offline_cache, "someorg/tiny-llama", TINY_LLAMA)
    assert hf_hub.fetch_config("someorg/tiny-llama") == cached
    built = build_model("hf:someorg/tiny-llama")
    assert type(built.module).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in built.module.parameters()) == TINY_LLAMA_PARAMS
    assert built.info["config_path"] == str(cached)


@pytest.mark.parametrize(
    ("repo_id", "name"),
    # a shipped id at a revision is read from the hub cache too, in any spelling the shipped
    # lookup reads (a hunt: gpt2@main kept the old trace; the org--name one was a traceback)
    [("someorg/tiny-llama", "someorg/tiny-llama"), ("gpt2", "gpt2@main"),
     ("gpt2", "GPT2@main"), ("meta-llama/Llama-3.2-1B", "meta-llama--Llama-3.2-1B@main"),
     ("tiny-bare-llama", "tiny-bare-llama")],
)  # fmt: skip
def test_an_updated_hub_config_is_traced_afresh(offline_cache: Path, repo_id, name) -> None:
    """The trace cache keys a hub id on the config.json its ref points at: ``hf download``
    of a changed repo adds a snapshot and moves ``refs/main``, and the old graph must not
    be served for it."""
    from boom_ml.specs import ModelSpec, StepSpec
    from boom_ml.trace_cache import cache_key

    _populate_cache(offline_cache, repo_id, TINY_LLAMA)
    assert build_model(f"hf:{name}").module.config.num_hidden_layers == 2
    model, step = ModelSpec(f"hf:{name}"), StepSpec()
    before = cache_key(model, step)
    repo = offline_cache / ("models--" + repo_id.replace("/", "--"))
    newer = repo / "snapshots" / ("f" * 40)
    newer.mkdir()
    (newer / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 4}))
    assert cache_key(model, step) == before  # refs/main still names the old snapshot
    (repo / "refs" / "main").write_text("f" * 40)
    assert cache_key(model, step) != before


def test_a_pinned_revision_reads_that_snapshot(offline_cache: Path) -> None:
    """``hf:org/name@rev``: a tag or a commit hash picks its own snapshot, offline; an
    uncached revision's error names the download that would fetch it."""
    first = _populate_cache(offline_cache, "someorg/tiny-llama", TINY_LLAMA)
    repo = offline_cache / "models--someorg--tiny-llama"
    (repo / "snapshots" / ("f" * 40)).mkdir()
    (repo / "snapshots" / ("f" * 40) / "config.json").write_text(
        json.dumps({**TINY_LLAMA, "num_hidden_layers": 4})
    )
    (repo / "refs" / "v2").write_text("f" * 40)
    layers = {
        rev: build_model(f"hf:someorg/tiny-llama{rev}").module.config.num_hidden_layers
        for rev in ("", "@v2", "@" + "f" * 40, "@" + first.parent.name)
    }
    assert layers == {"": 2, "@v2": 4, "@" + "f" * 40: 4, "@" + first.parent.name: 2}
    with pytest.raises(UnknownModelError) as err:
        build_model("hf:someorg/tiny-llama@v3")
    assert "`hf download someorg/tiny-llama config.json --revision v3`" in str(err.value)


def test_hf_home_locates_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = _populate_cache(tmp_path / "hub", "someorg/other", TINY_LLAMA)
    assert hf_hub.cache_dir() == tmp_path / "hub"
    assert hf_hub.fetch_config("someorg/other") == cached


def test_offline_and_uncached_is_one_line_saying_what_to_do(offline_cache: Path) -> None:
    with pytest.raises(UnknownModelError) as err:
        build_model("hf:someorg/not-cached")
    text = str(err.value)
    assert "\n" not in text
    assert text == (
        "hf:someorg/not-cached is not shipped and its config.json is not in the local Hugging "
        f"Face cache ({offline_cache}), and HF_HUB_OFFLINE is set; with network access, unset it "
        "(HF_HUB_OFFLINE=0), or run `hf download someorg/not-cached config.json`, or pass a "
        "local config.json path as hf:<path>"
    )


def test_shipped_configs_win_over_the_cache(offline_cache: Path) -> None:
    _populate_cache(offline_cache, "Qwen/Qwen2.5-7B", {**TINY_LLAMA})
    built = build_model("hf:Qwen/Qwen2.5-7B")
    assert built.info["config_path"].endswith("Qwen--Qwen2.5-7B.json")


def test_online_downloads_config_json_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls: list[tuple] = []

    def fake_download(repo_id: str, filename: str, **kwargs: object) -> str:
        calls.append((repo_id, filename, kwargs.get("cache_dir"), kwargs.get("revision")))
        return str(_populate_cache(tmp_path, repo_id, TINY_LLAMA))

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(hf_hub, "hub_resolves", lambda: True)
    built = build_model("hf:someorg/remote-llama")
    build_model("hf:someorg/pinned-llama@refs/pr/1")
    assert calls == [
        ("someorg/remote-llama", "config.json", tmp_path, None),
        ("someorg/pinned-llama", "config.json", tmp_path, "refs/pr/1"),
    ]
    assert sum(p.numel() for p in built.module.parameters()) == TINY_LLAMA_PARAMS


def _http_error(cls: type, status: int) -> Exception:
    response = SimpleNamespace(status_code=status, headers={}, request=None, url="x")
    err = cls.__new__(cls)
    Exception.__init__(err, f"{status} error")
    err.response = response
    return err


@pytest.mark.parametrize(
    ("error_name", "status", "expected", "match"),
    [
        ("GatedRepoError", 403, InvalidInputError, "gated repository: set HF_TOKEN"),
        ("RepositoryNotFoundError", 401, InvalidInputError, "needs authentication.*HF_TOKEN"),
        ("RepositoryNotFoundError", 404, UnknownModelError, "no such repository"),
        ("RemoteEntryNotFoundError", 404, UnknownModelError, "has no config.json"),
        ("RevisionNotFoundError", 404, UnknownModelError, "locked@v9: no revision 'v9' on"),
    ],
)
def test_hub_errors_are_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    error_name: str,
    status: int,
    expected: type,
    match: str,
) -> None:
    import huggingface_hub
    from huggingface_hub import errors

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)

    def fail(*args: object, **kwargs: object) -> str:
        raise _http_error(getattr(errors, error_name), status)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    monkeypatch.setattr(hf_hub, "hub_resolves", lambda: True)
    with pytest.raises(expected, match=match) as err:
        build_model("hf:someorg/locked@v9")
    assert "\n" not in str(err.value)


def test_no_connection_falls_back_to_the_same_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def fail(*args: object, **kwargs: object) -> str:
        raise LocalEntryNotFoundError("connection error")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    monkeypatch.setattr(hf_hub, "hub_resolves", lambda: True)
    with pytest.raises(UnknownModelError, match="could not reach the Hugging Face hub"):
        build_model("hf:someorg/unreachable")


def test_no_name_resolution_fails_at_once_without_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    import huggingface_hub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    looked_up: list[object] = []

    def no_dns(host: object, *args: object) -> list:
        looked_up.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    def must_not_download(*args: object, **kwargs: object) -> str:
        raise AssertionError("hf_hub_download called without a resolvable hub")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", must_not_download)
    with pytest.raises(UnknownModelError, match="could not reach the Hugging Face hub"):
        build_model("hf:someorg/nodns")
    assert looked_up == ["huggingface.co"]
    # behind a proxy the proxy resolves the hub: no lookup here, the download is tried
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hf_hub.hub_resolves() and looked_up == ["huggingface.co"]


def test_paths_and_bare_names_are_not_hub_ids(tmp_path: Path, monkeypatch) -> None:
    assert hf_hub.looks_like_repo_id("Qwen/Qwen2.5-7B")
    assert not hf_hub.looks_like_repo_id("gpt2")
    assert not hf_hub.looks_like_repo_id("../shared/config.json")
    assert not hf_hub.looks_like_repo_id("/abs/path/config.json")
    folder = tmp_path / "org"
    (folder / "name").mkdir(parents=True)
    (folder / "name" / "config.json").write_text(json.dumps(TINY_LLAMA))
    # an existing local folder spelled like a hub id is a path
    assert not hf_hub.looks_like_repo_id(str(folder / "name"))
    # ... when it holds a config: an empty one in the working directory hid a cached id
    monkeypatch.chdir(tmp_path)
    assert not hf_hub.looks_like_repo_id("org/name")
    (tmp_path / "other" / "name").mkdir(parents=True)
    assert hf_hub.looks_like_repo_id("other/name")


def test_offline_error_names_close_shipped_configs(offline_cache: Path) -> None:
    with pytest.raises(UnknownModelError) as err:
        build_model("hf:Qwen/Qwen2.5-7B-Instruct")
    text = str(err.value)
    assert "\n" not in text and text.startswith("hf:Qwen/Qwen2.5-7B-Instruct is not shipped")
    assert text.endswith(
        "(shipped, close in name: hf:Qwen/Qwen2.5-7B, hf:Qwen/Qwen2.5-72B, hf:Qwen/Qwen2.5-3B)"
    )
    # a hunt: a revision the cache lacks had been pointed at other models ("same family")
    with pytest.raises(UnknownModelError) as err:
        build_model("hf:Qwen/Qwen2.5-7B-Instruct@nope")
    assert "shipped, close in name" not in str(err.value)


def test_an_unknown_model_type_is_one_short_line(tmp_path: Path) -> None:
    """transformers' own error lists every model type (12 KB on one line): the typo is named
    with the close ones, and a hub model's own code (auto_map) is said not to run here."""
    from boom_ml.zoo.hf_config import load_config

    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"model_type": "gtp2", "n_layer": 2}))
    with pytest.raises(
        InvalidInputError, match=r"no model_type 'gtp2' \(did you mean: gpt2"
    ) as err:
        load_config(typo)
    assert len(str(err.value)) < 300
    remote = tmp_path / "remote.json"
    remote.write_text(json.dumps({"model_type": "my_custom", "auto_map": {"AutoConfig": "m.C"}}))
    with pytest.raises(InvalidInputError, match="auto_map: not run here"):
        load_config(remote)


def test_a_shipped_id_at_a_revision_is_read_from_the_cache(offline_cache: Path) -> None:
    """``hf:gpt2@main`` asks for a revision, which the shipped config (one revision) cannot
    answer: it is read from the cache (an id without an org is a hub id too); uncached, the
    error says so and names the shipped config, without calling it "not shipped"."""
    _populate_cache(offline_cache, "gpt2", TINY_LLAMA)
    assert build_model("hf:gpt2@main").module.config.num_hidden_layers == 2
    assert build_model("hf:gpt2").module.config.n_layer == 12  # the shipped one
    with pytest.raises(UnknownModelError) as err:
        build_model("hf:meta-llama/Meta-Llama-3-8B@v1")
    text = str(err.value)
    assert text.startswith("hf:meta-llama/Meta-Llama-3-8B@v1: the config.json of that revision")
    assert text.endswith("(hf:meta-llama/Meta-Llama-3-8B alone is the shipped config)")
    assert "not shipped" not in text and "\n" not in text


def test_a_short_hash_and_a_bare_architectures_string(offline_cache: Path, tmp_path: Path) -> None:
    """The hub cache keys a commit by its full hash: a short one is told so. A config whose
    architectures is one bare string (not a list) is that class, not its first letter."""
    _populate_cache(offline_cache, "someorg/tiny-llama", TINY_LLAMA)
    with pytest.raises(UnknownModelError, match="full 40-character hash"):
        build_model("hf:someorg/tiny-llama@abc1234")
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({**TINY_LLAMA, "architectures": "LlamaForCausalLM"}))
    built = build_model(f"hf:{bare}")
    assert type(built.module).__name__ == "LlamaForCausalLM" and not built.info["notes"]


def test_an_id_without_an_org_is_read_from_the_cache(offline_cache: Path) -> None:
    """The hub's oldest ids have no org (roberta-base); a hunt found one refused although
    cached. Cached: built from the cache; not cached: the unknown-model line says where to
    put it, with no hub round trip for what may be a typo of a shipped id."""
    cached = _populate_cache(offline_cache, "tiny-bare-llama", TINY_LLAMA)
    built = build_model("hf:tiny-bare-llama")
    assert built.info["config_path"] == str(cached)
    assert sum(p.numel() for p in built.module.parameters()) == TINY_LLAMA_PARAMS
    with pytest.raises(UnknownModelError) as err:
        build_model("hf:gpt2-larg")
    text = str(err.value)
    assert "\n" not in text and "did you mean: hf:gpt2-large" in text
    assert text.endswith(
        f"read from the local Hugging Face cache only ({offline_cache}): "
        "`hf download gpt2-larg config.json` puts it there"
    )
    assert hf_hub.looks_like_bare_id("roberta-base@v1")
    assert not hf_hub.looks_like_bare_id("Qwen/Qwen2.5-7B")
    assert not hf_hub.looks_like_bare_id("config.json")
