"""Hugging Face hub names for models and datasets, beside local paths.

    resolve_model("Qwen/Qwen2.5-0.5B-Instruct")      # -> the snapshot directory in the hub cache
    resolve_model("Qwen/Qwen2.5-0.5B-Instruct@main")  # any branch, tag or commit after @
    load_dataset_spec("openai/gsm8k:main:test")       # ORG/NAME[@REV][:CONFIG][:SPLIT] -> datasets.Dataset
    load_dataset_spec("openai/gsm8k:main")            # a lone name is a config where the repo has one so named
    load_dataset_spec("train.jsonl")                  # a local file or directory, as colo.grpo.task reads it
    pinned("openai/gsm8k:main:train", kind="dataset") # -> "openai/gsm8k@<commit>:main:train"

A path that exists always wins. Otherwise ORG/NAME (exactly one slash, a valid hub repo id) is a hub
id; an absolute path, ./x, ../x, ~/x, or (for datasets) a name ending in .jsonl/.json/.parquet/.csv is
a path, and gets the "no such file" error of a missing path.

Hub ids go through huggingface_hub.snapshot_download with its cache (HF_HUB_CACHE, default
~/.cache/huggingface/hub), so the files come down once and HF_HUB_OFFLINE=1 then works from the filled
cache. huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE once, when it is imported; these functions
read those two again on every call (HF_HUB_OFFLINE=1 in the environment now, or huggingface_hub's own
flag, means offline: snapshot_download(local_files_only=True), no request at all), so setting them later
in a process still applies here (HF_HOME and the legacy HUGGINGFACE_HUB_CACHE only at import). A name that is neither a local
path nor in the cache / on the hub is one ValueError that says which.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DATA_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
# Files of a model repo that neither transformers nor vLLM reads for a PyTorch safetensors/bin model:
# the original checkpoints some repos carry beside the Hugging Face ones, other frameworks' weights.
MODEL_IGNORE = ["original/*", "*.pth", "*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.h5", "*.msgpack", "*.ot",
                "*.tflite", "*.mlmodel", "coreml/*", "openvino/*"]
_TRUE = {"1", "ON", "YES", "TRUE"}
# A dataset's text after ORG/NAME[@REVISION]: (a revision never holds ':', git refs cannot) [CONFIG:]SPLIT,
# where SPLIT may be sliced and so hold ':' itself ("train[:100]").
_CONFIG_SPLIT = re.compile(r"(?:(?P<config>[\w\-.]+):)?(?P<split>.+)")


@dataclass(frozen=True)
class HubName:
    """A hub id as parsed from a flag: repo ORG/NAME, revision (None: the default branch), and what
    follows the first ':' (datasets: [CONFIG:]SPLIT; None when absent)."""

    repo_id: str
    revision: str | None
    rest: str | None

    def text(self, revision: str | None) -> str:
        at = f"@{revision}" if revision else ""
        return f"{self.repo_id}{at}" + (f":{self.rest}" if self.rest is not None else "")


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now, or huggingface_hub's flag read at its import."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or any(
        (os.environ.get(name) or "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache(cache_dir: str | Path | None = None) -> Path:
    """The hub cache: cache_dir, else HF_HUB_CACHE set now, else huggingface_hub's (read at its import)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def parse_hub_name(spec: str | Path, *, dataset: bool = False) -> HubName | None:
    """The hub id `spec` names, or None when it is a path (see the module doc for the rule)."""
    if isinstance(spec, Path):
        return None
    text = str(spec)
    if not text or Path(text).expanduser().exists():
        return None
    if text.startswith(("/", "./", "../", "~")) or text in (".", ".."):
        return None
    head, colon, rest = text.partition(":")
    if colon and (not dataset or not rest):
        return None
    repo_id, at, revision = head.partition("@")
    if at and not revision:
        return None
    if dataset and repo_id.lower().endswith(DATA_EXTENSIONS):
        return None
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubName(repo_id, revision or None, rest if colon else None)


def resolve_model(name_or_path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """A local directory as it is; otherwise a hub id ORG/NAME[@REVISION] fetched into (or, offline,
    found in) the hub cache: its snapshot directory. A ValueError naming the model and saying where it
    was looked for when it is neither."""
    name = parse_hub_name(name_or_path)
    if name is None:
        path = Path(name_or_path)
        if not path.exists():
            raise ValueError(f"{path}: no such directory")
        if not path.is_dir():
            raise ValueError(f"{path}: a file, not a model directory")
        return path
    return _snapshot(name, "model", cache_dir, str(name_or_path))


def load_dataset_file(path: str | Path):
    """A `datasets.Dataset` from a JSONL/JSON, Parquet or CSV file or a save_to_disk directory."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError("reading a dataset needs the `datasets` package: pip install 'colo[tasks]'") from e
    path = Path(path)
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{path} is not a dataset saved with save_to_disk: {e}") from e
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"{path} holds splits {list(loaded)}, none named 'train'; point at one split")
            loaded = loaded["train"]
        return loaded
    if not path.is_file():
        raise ValueError(f"dataset {path}: no such file or directory")
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    builder = builders.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"dataset {path}: unknown format {path.suffix!r}; give .jsonl, .json, .parquet, .csv "
                         "or a save_to_disk directory")
    if path.stat().st_size == 0:
        raise ValueError(f"dataset {path}: the file is empty")
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for unreadable files
        # (datasets wraps the parser's own error, which says where: the line and what is wrong there)
        cause = e.__cause__ if e.__cause__ is not None else e
        raise ValueError(f"dataset {path}: cannot read it as {builder}: {type(cause).__name__}: {cause}") from e


def load_dataset_spec(spec: str | Path, *, cache_dir: str | Path | None = None):
    """A datasets.Dataset: a local file or directory through load_dataset_file, or
    ORG/NAME[@REVISION][:CONFIG][:SPLIT] (split default "train"; a split may be sliced, "train[:100]";
    ORG/NAME:X is config X's train split where the repo has a config X, else split X)
    fetched into (or, offline, found in) the hub cache and read with datasets.load_dataset from the
    snapshot (datasets infers the files, configs and splits from the hub's layout and README). A
    ValueError for a name that is neither, a missing config or split (naming the ones there), or
    files datasets cannot read."""
    name = parse_hub_name(spec, dataset=True)
    if name is None:
        return load_dataset_file(spec)
    config, split = _config_split(name, str(spec))
    snapshot = _snapshot(name, "dataset", cache_dir, str(spec))
    try:
        import datasets
    except ImportError as e:
        raise ImportError("reading a dataset needs the `datasets` package: pip install 'colo[tasks]'") from e
    where = f"dataset {spec}"
    try:
        configs = datasets.get_dataset_config_names(str(snapshot))
        default = datasets.get_dataset_default_config_name(str(snapshot))
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for a repo it cannot read
        raise ValueError(f"{where}: datasets cannot read the snapshot at {snapshot}: {type(e).__name__}: {e}") from e
    if config is None and split in configs:  # ORG/NAME:CONFIG, as "openai/gsm8k:main": its train split
        config, split = split, "train"
    if config is None and default is None:
        raise ValueError(f"{where}: {name.repo_id} has configs {', '.join(configs)} and no default; name one, e.g. "
                         f"{name.repo_id}:{configs[0]}:{split}")
    if config is not None and config not in configs:
        raise ValueError(f"{where}: {name.repo_id} has no config {config!r} (it has {', '.join(configs)})")
    try:
        builder = datasets.load_dataset_builder(str(snapshot), name=config)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{where}: datasets cannot read the snapshot at {snapshot}: {type(e).__name__}: {e}") from e
    splits = list(builder.config.data_files or ())
    wanted = [part.split("[", 1)[0].strip() for part in split.split("+")]
    missing = [s for s in wanted if s not in splits]
    if splits and missing:
        shown = f"{name.repo_id}" + (f" config {config!r}" if config else "")
        raise ValueError(f"{where}: {shown} has no split {missing[0]!r} (its splits: {', '.join(splits)})")
    try:
        return datasets.load_dataset(str(snapshot), name=config, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for unreadable files
        raise ValueError(f"{where}: cannot read {split!r} from the snapshot at {snapshot}: "
                         f"{type(e).__name__}: {e}") from e


def pinned(spec: str | Path, *, kind: str, cache_dir: str | Path | None = None) -> str:
    """`spec` with a hub id's revision replaced by the commit it resolves to now (fetching it if needed),
    e.g. "org/name:test" -> "org/name@<40 hex>:test"; a local path unchanged. For run.json: a resumed run
    then reads the very files the first one did, from the cache, even after the hub's branch moved on."""
    if kind not in ("model", "dataset"):
        raise ValueError(f"kind must be 'model' or 'dataset', got {kind!r}")
    name = parse_hub_name(spec, dataset=kind == "dataset")
    if name is None:
        return str(spec)
    if kind == "dataset":
        _config_split(name, str(spec))
    return name.text(_snapshot(name, kind, cache_dir, str(spec)).name)


def _config_split(name: HubName, spec: str) -> tuple[str | None, str]:
    match = _CONFIG_SPLIT.fullmatch(name.rest) if name.rest else None
    if name.rest is not None and match is None:
        raise ValueError(f"dataset {spec}: expected ORG/NAME[@REVISION][:CONFIG][:SPLIT]")
    return (match["config"], match["split"].strip()) if match else (None, "train")


def _snapshot(name: HubName, repo_type: str, cache_dir, spec: str) -> Path:
    """snapshot_download of the repo (offline: local_files_only), its errors as one ValueError."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    cache = hub_cache(cache_dir)
    local = offline()
    what = "directory" if repo_type == "model" else "file or directory"
    lead = f"{spec}:" if repo_type == "model" else f"dataset {spec}:"
    kind = "model" if repo_type == "model" else "dataset"
    absent = f"revision {name.revision!r} is not" if name.revision else "not"
    try:
        path = snapshot_download(name.repo_id, repo_type=repo_type, revision=name.revision, cache_dir=str(cache),
                                 local_files_only=local,
                                 ignore_patterns=MODEL_IGNORE if repo_type == "model" else None)
    except IncompleteSnapshotError as e:
        raise ValueError(f"{lead} the Hugging Face cache at {cache} holds only part of {name.repo_id} and it cannot "
                         f"be completed now{' (HF_HUB_OFFLINE=1)' if local else ''}: {e}") from e
    except LocalEntryNotFoundError as e:
        if local:
            raise ValueError(f"{lead} not a local {what}, and {absent} in the Hugging Face cache at {cache} "
                             "(HF_HUB_OFFLINE=1)") from e
        cause = e.__cause__ or e
        raise ValueError(f"{lead} not a local {what}, {absent} in the Hugging Face cache at {cache}, and the "
                         f"Hugging Face hub cannot be reached ({type(cause).__name__}: {cause})") from e
    except GatedRepoError as e:
        raise ValueError(f"{lead} not a local {what}; the {kind} {name.repo_id} on the Hugging Face hub is gated: ask "
                         "for access on its page and log in (hf auth login, or HF_TOKEN)") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"{lead} not a local {what}, and not a {kind} on the Hugging Face hub (nor a private one "
                         "you can see: log in with hf auth login, or HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"{lead} the {kind} {name.repo_id} on the Hugging Face hub has no revision "
                         f"{name.revision!r}") from e
    except HfHubHTTPError as e:
        raise ValueError(f"{lead} the Hugging Face hub refused {name.repo_id}: {e}") from e
    return Path(path)
