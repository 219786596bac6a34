"""A hub id's ``config.json`` from the local Hugging Face cache, or downloaded alone.

``hf:<org>/<name>`` that is not shipped is looked up in the local cache first (``HF_HUB_CACHE``,
else ``HF_HOME/hub``, else huggingface_hub's default), which works offline; when nothing is
cached and ``HF_HUB_OFFLINE`` is not set, ``config.json`` alone is downloaded (never weights)
with ``huggingface_hub.hf_hub_download``, into that same cache. ``hf:<org>/<name>@<revision>``
pins a branch, tag or commit (the cache is read at that revision, and that revision is
downloaded). ``hf:<name>`` without an org (the hub's oldest ids, ``roberta-base``) is read
from the cache only. Every failure is one line that says what to do.

The environment is read at call time, not when huggingface_hub was imported, so a test (or a
notebook) that sets ``HF_HUB_OFFLINE`` / ``HF_HUB_CACHE`` afterwards is obeyed.
"""

from __future__ import annotations

import os
import re
import socket
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from boom_ml.errors import InvalidInputError, UnknownModelError

CONFIG_NAME = "config.json"
# org/name as the hub spells repo ids (one slash, no path tricks), then an optional
# @revision: a branch or tag (which may hold slashes, as refs/pr/1) or a commit hash
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-]+(/[\w.\-]+)*)?$")
# an id without an org (roberta-base, distilbert-base-uncased): the hub's oldest repos
_BARE_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(@[\w.\-]+(/[\w.\-]+)*)?$")
_TRUE = {"1", "on", "yes", "true"}


def looks_like_repo_id(name: str) -> bool:
    """``org/name[@revision]`` that is no local config (a file, or a folder holding
    config.json, always wins; an empty folder of the id's name in the working directory
    does not hide the hub id)."""
    path = Path(name).expanduser()
    return (
        bool(_REPO_ID.match(name))
        and ".." not in name
        and not name.endswith(".json")  # a config path that does not exist, not a revision
        and not path.is_file()
        and not (path / CONFIG_NAME).is_file()
    )


def looks_like_bare_id(name: str) -> bool:
    """``name[@revision]`` without an org that is no local file or folder: read from the
    local cache only, never downloaded (a typo of a shipped id would otherwise cost a hub
    round trip before its "did you mean")."""
    path = Path(name).expanduser()
    return bool(_BARE_ID.match(name)) and not name.endswith(".json") and not path.exists()


def split_revision(name: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``); without ``@``, the revision is None (main)."""
    repo_id, _, revision = name.partition("@")
    return repo_id, revision or None


def download_hint(name: str) -> str:
    """The command that puts ``name``'s config.json into the cache."""
    repo_id, revision = split_revision(name)
    pin = f" --revision {revision}" if revision else ""
    return f"`hf download {repo_id} config.json{pin}`"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (1 / on / yes / true)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> Path:
    """The hub cache folder: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_config(name: str) -> Path | None:
    """The cached ``config.json`` of ``org/name[@revision]`` (default ``main``), offline."""
    from huggingface_hub import try_to_load_from_cache

    repo_id, revision = split_revision(name)
    found = try_to_load_from_cache(repo_id, CONFIG_NAME, cache_dir=cache_dir(), revision=revision)
    return Path(found) if isinstance(found, str) else None


def _not_found(repo_id: str) -> str:
    """The start of the message: a pinned revision is asked of the cache whether or not
    the model is shipped (the shipped config is one revision)."""
    if "@" in repo_id:
        revision = repo_id.partition("@")[2]
        if re.fullmatch(r"[0-9a-f]{7,39}", revision):  # the hub cache keys full hashes
            return (f"hf:{repo_id}: a commit is named by its full 40-character hash in the "
                    "local Hugging Face cache; the config.json of that revision is not in the ")  # fmt: skip
        return f"hf:{repo_id}: the config.json of that revision is not in the local Hugging Face "
    return f"hf:{repo_id} is not shipped and its config.json is not in the local Hugging Face "


def _offline_message(repo_id: str) -> str:
    return _not_found(repo_id) + (
        f"cache ({cache_dir()}), and HF_HUB_OFFLINE is set; with network access, unset it "
        f"(HF_HUB_OFFLINE=0), or run {download_hint(repo_id)}, or "
        "pass a local config.json path as hf:<path>"
    )


def _unreachable_message(repo_id: str) -> str:
    return (
        f"hf:{repo_id}: could not reach the Hugging Face hub and its config.json is not "
        f"cached ({cache_dir()}); run {download_hint(repo_id)} "
        "where there is network, or pass a local config.json path as hf:<path>"
    )


def hub_resolves() -> bool:
    """Whether the hub's host name resolves (always true behind a proxy, which resolves it).

    On a machine without network huggingface_hub retries its request five times, about
    30 s, before it gives up; a failed name lookup says the same at once.
    """
    proxies = urllib.request.getproxies()  # the environment's, as requests reads them
    if proxies.get("https") or proxies.get("all"):
        return True
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def fetch_config(repo_id: str) -> Path:
    """``config.json`` of a hub repo: from the cache, else downloaded (config only).

    Raises UnknownModelError when the repo or its config does not exist or cannot be
    reached, InvalidInputError for gated / private repos (a line about ``HF_TOKEN``).
    """
    hit = cached_config(repo_id)
    if hit is not None:
        return hit
    if offline():
        raise UnknownModelError(_offline_message(repo_id))
    if not hub_resolves():
        raise UnknownModelError(_unreachable_message(repo_id))
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token_hint = (
        "set HF_TOKEN to a token of an account that accepted its terms"
        if not os.environ.get("HF_TOKEN")
        else "the token in HF_TOKEN has no access to it (accept the terms on its hub page)"
    )
    repo, revision = split_revision(repo_id)
    try:
        return Path(hf_hub_download(repo, CONFIG_NAME, cache_dir=cache_dir(), revision=revision))
    except GatedRepoError as err:  # before RepositoryNotFoundError: it is a subclass
        raise InvalidInputError(f"hf:{repo_id} is a gated repository: {token_hint}") from err
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as err:
        # no connection (or offline mode switched on after import): same advice as offline
        raise UnknownModelError(_unreachable_message(repo_id)) from err
    except RepositoryNotFoundError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status == 401:  # private, or gated without a token: the hub cannot say which
            raise InvalidInputError(
                f"hf:{repo_id} needs authentication (private or gated): {token_hint}"
            ) from err
        raise UnknownModelError(
            f"hf:{repo_id}: no such repository on the Hugging Face hub"
        ) from err
    except RevisionNotFoundError as err:
        raise UnknownModelError(
            f"hf:{repo_id}: no revision {revision or 'main'!r} on the hub"
        ) from err
    except (RemoteEntryNotFoundError, EntryNotFoundError) as err:
        raise UnknownModelError(f"hf:{repo_id} has no config.json on the hub") from err
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            raise InvalidInputError(
                f"hf:{repo_id} refused access ({status}): {token_hint}"
            ) from err
        raise UnknownModelError(
            f"hf:{repo_id}: the hub answered {status}: {err}".split("\n")[0]
        ) from err
