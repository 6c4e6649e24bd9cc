"""Models named by their Hugging Face Hub id, fetched into the hub's own cache.

    checkpoint_dir("HuggingFaceTB/SmolLM2-135M-Instruct")        # -> local snapshot directory
    hub_file("org/name-GGUF", "model-Q4_0.gguf")                 # -> local path of one file
    model_file("org/name:model.gguf")                            # pyklei.load's form of it

huggingface_hub does the work (snapshot_download / hf_hub_download): its cache
(HF_HUB_CACHE, HF_HOME), its token (HF_TOKEN or `hf auth login`), its offline mode
(HF_HUB_OFFLINE=1: only what the cache holds). What this module adds is the rule for when an
argument is a hub id (not an existing local path, and shaped `org/name`) and one-line errors
that say what to do: a hub that cannot be reached gets the way to use a local directory
instead.

A leaf: the converters, the runtime and the CLI all call it; it imports nothing of pyklei.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

# what a checkpoint needs: config and tokenizer files, the weights as safetensors (not the
# .bin/.pth copies many repos also carry), a SentencePiece model where there is one
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model")

# org/name as the hub spells repo ids: letters, digits, '-', '_', '.'; no '..' or '--'
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
# org/name:file.gguf (the file may sit in a folder of the repo)
_FILE_RE = re.compile(r"^(?P<repo>[^:/\s]+/[^:/\s]+):(?P<file>[^:\s]+\.gguf)$")


class HubError(ValueError):
    """A hub id that could not be turned into local files; the message says why and what to do."""


def is_repo_id(arg) -> bool:
    """Whether `arg` names a hub repository rather than a local path: no such path exists
    here, and it reads `org/name`."""
    s = os.fspath(arg)
    return not os.path.exists(s) and bool(_REPO_RE.match(s)) and ".." not in s and "--" not in s


def split_file_ref(arg) -> tuple[str, str] | None:
    """(repo id, file) of `org/name:file.gguf` when no such local path exists; else None."""
    s = os.fspath(arg)
    m = _FILE_RE.match(s)
    if m is None or os.path.exists(s) or not is_repo_id(m["repo"]):
        return None
    return m["repo"], m["file"]


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise HubError("downloading from the Hugging Face Hub needs huggingface_hub: "
                       "pip install huggingface_hub") from None
    return huggingface_hub


def _fail(e: Exception, repo_id: str, what: str, revision: str | None,
          local_hint: str) -> HubError:
    """The HubError for huggingface_hub's exception `e` while fetching `what` of repo_id. The
    id might also be a local path mistyped: the messages say that none exists."""
    from huggingface_hub import errors as E

    def one_line(x) -> str:
        return " ".join(str(x).split())

    if isinstance(e, E.LocalEntryNotFoundError):      # no network (or offline) and not cached
        offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
        why = "HF_HUB_OFFLINE is set" if offline else "no network; HF_HUB_OFFLINE=1 skips the tries"
        return HubError(f"could not reach the Hugging Face Hub for {what} of {repo_id} ({why}), "
                        f"and the hub cache ({_cache_dir()}) does not hold it; there is no local "
                        f"path {repo_id} either: download it where there is network, or "
                        f"{local_hint}")
    if isinstance(e, E.GatedRepoError):
        return HubError(f"{repo_id} is gated: accept its licence on huggingface.co and set "
                        f"HF_TOKEN (or run `hf auth login`)")
    if isinstance(e, E.RepositoryNotFoundError):
        return HubError(f"no repository {repo_id} on the Hugging Face Hub (or it is private: "
                        f"set HF_TOKEN), and no local path {repo_id}")
    if isinstance(e, E.RevisionNotFoundError):
        return HubError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit)")
    if isinstance(e, E.EntryNotFoundError):
        return HubError(f"{repo_id} has no file {what}")
    if isinstance(e, E.HFValidationError):
        return HubError(f"{repo_id!r} is not a Hugging Face repository id: {one_line(e)}")
    return HubError(f"downloading {what} of {repo_id} failed: {type(e).__name__}: {one_line(e)}")


def _cache_dir() -> str:
    from huggingface_hub import constants
    return str(constants.HF_HUB_CACHE)


def checkpoint_dir(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot of a Hugging Face checkpoint repo (safetensors, config, tokenizer),
    downloaded into the hub cache if it is not there. Raises HubError."""
    hub = _hub()
    what = "the checkpoint" + (f" at revision {revision}" if revision else "")
    try:
        path = Path(hub.snapshot_download(repo_id, revision=revision,
                                          allow_patterns=list(CHECKPOINT_PATTERNS)))
    except Exception as e:
        raise _fail(e, repo_id, what, revision, "give the path of a local checkpoint directory "
                                                "(config.json, *.safetensors, tokenizer files)") from None
    if not any(path.rglob("*.safetensors")):
        ggufs = _gguf_files(hub, repo_id, revision)
        hint = (f"it holds GGUF files: name one with --file (e.g. --file {ggufs[0]})" if ggufs
                else "pyklei converts safetensors checkpoints or GGUF files")
        raise HubError(f"{repo_id} has no .safetensors weights; {hint}")
    return path


def _gguf_files(hub, repo_id: str, revision: str | None) -> list[str]:
    """The repo's .gguf files, as far as the hub (or nothing, offline) tells."""
    try:
        return sorted(f for f in hub.list_repo_files(repo_id, revision=revision)
                      if f.endswith(".gguf"))
    except Exception:
        return []


def hub_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """The local path of one file of a hub repo, downloaded into the hub cache if it is not
    there. Raises HubError."""
    hub = _hub()
    what = filename + (f" at revision {revision}" if revision else "")
    try:
        return Path(hub.hf_hub_download(repo_id, filename, revision=revision))
    except Exception as e:
        raise _fail(e, repo_id, what, revision, f"give the path of a local copy of {filename}") from None


def model_file(arg, is_model: Callable[[Path], bool] | None = None) -> Path:
    """`arg` as a local path: `org/name:file.gguf` is fetched from the hub (HubError if it
    cannot be); anything else is returned as it is, for the loader to check. The one place a
    model argument is resolved (pyklei.load, bench, the CLI). is_model(path): whether a fetched
    file is a pyklei model file; one that is not (a llama.cpp GGUF, what most GGUF repos hold)
    is a HubError whose convert line names the repo, not the cache's path."""
    ref = split_file_ref(arg)
    if ref is None:
        return Path(arg)
    path = hub_file(*ref)
    if is_model is not None and not is_model(path):
        raise HubError(f"{arg} is not a pyklei model file; convert it with `pyklei convert "
                       f"{ref[0]} --file {ref[1]} -o OUT.gguf`")
    return path
