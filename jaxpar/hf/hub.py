"""A Hugging Face model named by a local directory or a Hub model id, as a local directory.

`model_dir(name, revision)` is what `python -m jaxpar.convert from-hf NAME [--revision REV]` and
`train.init_from=NAME` read from. A path that exists is a local directory and is used as it is,
even where it also reads as ORG/NAME. Anything else must be a Hub model id, ORG/NAME; it is
resolved by `huggingface_hub.snapshot_download`, which uses (and fills) its cache: HF_HUB_CACHE,
or HF_HOME/hub, by default ~/.cache/huggingface/hub. With HF_HUB_OFFLINE=1 only the cache is read;
a branch or tag is then looked up in the cache's refs, a commit hash directly. The token is
huggingface_hub's own: HF_TOKEN, or the one `hf auth login` stored.

Only the files jaxpar reads are fetched (FILES, and the shards that model.safetensors.index.json
lists): not the .bin, .pth or consolidated copies of the weights many repositories also carry.
What the Hub or the cache cannot give is a ConfigError of one line: a name that is neither a
directory nor an id, a model not in the cache offline (or with no network), a revision or
repository the Hub does not have, a gated or private repository without a token.
"""

from __future__ import annotations

import json
import os

from jaxpar.config import ConfigError

# What jaxpar.convert reads of a Hugging Face model directory (the shards come from the index).
FILES = [
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # a chat template saved on its own (transformers 5)
]


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hub model id ORG/NAME (huggingface_hub's rules for the parts)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def snapshot_of(path: str) -> tuple[str, str] | None:
    """(model id ORG/NAME, commit) of a snapshot directory in huggingface_hub's cache
    (`.../models--ORG--NAME/snapshots/COMMIT`, what `model_dir` gives for an id), else None."""
    path = os.path.abspath(path)
    snapshots, commit = os.path.split(path)
    repo, kind = os.path.split(snapshots)
    name = os.path.basename(repo)
    if kind != "snapshots" or not name.startswith("models--"):
        return None
    repo_id = name.removeprefix("models--").replace("--", "/")
    return (repo_id, commit) if is_repo_id(repo_id) else None


def model_dir(name: str, revision: str | None = None, where: str = "") -> str:
    """The absolute local directory of `name`: an existing path itself, else the Hub model id's
    snapshot at `revision` (a branch, tag or commit hash; None: the default branch) in
    huggingface_hub's cache. `where` prefixes the name in errors (e.g. "train.init_from=")."""
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.exists(path):
        if revision is not None:
            raise ConfigError(
                f"--revision {revision} selects a version of a Hub model id, but {where}{name} is a "
                "local directory (a local path wins over an id); leave --revision out"
            )
        return path
    if not is_repo_id(name):
        raise ConfigError(f"{where}{name}: no such directory, and not a Hugging Face Hub model id (ORG/NAME)")
    return _snapshot(name, revision, f"{where}{name}")


def _shards(snapshot: str) -> list[str]:
    """The files model.safetensors.index.json in `snapshot` lists ([] without a readable one:
    jaxpar.convert then says what is wrong with the directory)."""
    try:
        with open(os.path.join(snapshot, "model.safetensors.index.json")) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _snapshot(repo_id: str, revision: str | None, shown: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(repo_id, revision=revision, allow_patterns=FILES)
        if shards := _shards(snapshot):
            # The same commit (its snapshot directory's name): the branch may have moved since.
            commit = os.path.basename(snapshot)
            snapshot = snapshot_download(repo_id, revision=commit, allow_patterns=shards)
    except Exception as e:
        if (error := _error(e, repo_id, revision, shown)) is None:
            raise
        raise error from None
    return os.path.abspath(snapshot)


def _error(e: Exception, repo_id: str, revision: str | None, shown: str) -> ConfigError | None:
    """The ConfigError of one line that says what `snapshot_download`'s error `e` means for the
    user; None where it is none of those (a failure while downloading: not a setting)."""
    from huggingface_hub import constants, errors

    at = f"revision {revision}" if revision is not None else "its default branch"
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(e, errors.GatedRepoError):
        return ConfigError(
            f"{shown}: {repo_id} is gated on the Hugging Face Hub: accept its terms at "
            f"https://huggingface.co/{repo_id} with your account, then {login}"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return ConfigError(
            f"{shown}: no such directory, and no model {repo_id} on the Hugging Face Hub that this "
            f"machine may read (a private or gated one needs a token: {login})"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return ConfigError(
            f"{shown}: the Hugging Face Hub model {repo_id} has no revision {revision} "
            "(--revision takes a branch, a tag or a commit hash)"
        )
    if isinstance(e, errors.LocalEntryNotFoundError):
        cache = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE=1 is set, so nothing is downloaded: unset it, or fetch the model "
            why += f"where there is network (hf download {repo_id})"
        else:
            cause = type(e.__cause__).__name__ if e.__cause__ is not None else type(e).__name__
            why = f"the Hub could not be reached ({cause}): no network?"
        return ConfigError(
            f"{shown}: no such directory, and {repo_id} at {at} is not (completely) in the Hugging "
            f"Face cache {cache}; {why}"
        )
    if isinstance(e, errors.HfHubHTTPError) and e.response.status_code in (401, 403):
        return ConfigError(f"{shown}: the Hugging Face Hub refused access to {repo_id}; {login}")
    return None
