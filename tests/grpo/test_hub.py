"""colo.hub: Hugging Face hub names for --model and --dataset, offline, from a hub cache built here in
huggingface_hub's own on-disk layout (models--ORG--NAME/{blobs,snapshots/<commit>,refs/main,trees}),
holding the real SmolLM2-135M-Instruct directory (colo.smollm2) and small parquet datasets."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colo.hub import load_dataset_spec, parse_hub_name, pinned, resolve_model

REPO = Path(__file__).resolve().parents[2]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DATA = "colo-test/prompts"
GSM = "colo-test/gsm-like"
TRAIN = {"prompt": ["What is 1 + 1?", "What is 2 + 2?", "What is 3 + 3?"], "answer": ["2", "4", "6"]}
TEST = {"prompt": ["What is 10 + 10?", "What is 20 + 20?"], "answer": ["20", "40"]}
# Files the hub keeps in LFS: their blob is named by sha256; the others' by their git blob id.
LFS_SUFFIXES = (".safetensors", ".parquet")
GSM_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# A dataset laid out as openai/gsm8k is
"""


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


def add_repo(cache: Path, repo_id: str, files: dict[str, Path], *, repo_type: str = "model",
             tree_extra: dict[str, int] | None = None) -> Path:
    """Put `files` (repo path -> a file here) into `cache` as huggingface_hub's download writes them:
    blobs named by etag (sha256 for LFS files, git blob sha1 otherwise), snapshot entries as relative
    symlinks to them, refs/main holding the commit (no newline), trees/<commit>.json the listing.
    tree_extra: files the listing names but the snapshot lacks (an interrupted download)."""
    storage = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = commit_of(repo_id)
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True)
    (storage / "refs").mkdir()
    tree = {}
    for name, source in files.items():
        size = source.stat().st_size
        lfs = name.endswith(LFS_SUFFIXES)
        with open(source, "rb") as f:
            if lfs:
                etag = hashlib.file_digest(f, "sha256").hexdigest()
            else:
                etag = hashlib.sha1(b"blob %d\0" % size + f.read()).hexdigest()
        blob = storage / "blobs" / etag
        if not blob.exists():  # files of equal content share one blob
            try:
                os.link(source, blob)  # 0.5 GB of safetensors: no copy where the file system allows
            except OSError:
                shutil.copyfile(source, blob)
        pointer = snapshot / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
        tree[name] = {"size": size, "blob_id": hashlib.sha1(name.encode()).hexdigest(),
                      **({"lfs_sha256": etag, "lfs_size": size} if lfs else {})}
    for name, size in (tree_extra or {}).items():
        tree[name] = {"size": size, "blob_id": hashlib.sha1(name.encode()).hexdigest()}
    (storage / "refs" / "main").write_text(commit)
    (storage / "trees").mkdir()
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    return snapshot


def write_parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, smollm2_model_dir) -> Path:
    """A hub cache holding MODEL (the SmolLM2 directory), DATA (train and test splits), GSM (two configs
    declared in its README, as openai/gsm8k) and colo-test/partial (a snapshot missing a listed file)."""
    cache = tmp_path_factory.mktemp("hub") / "hub"
    add_repo(cache, MODEL, {p.name: p for p in sorted(Path(smollm2_model_dir).iterdir()) if p.is_file()})
    files = tmp_path_factory.mktemp("data-files")
    add_repo(cache, DATA, {"data/train-00000-of-00001.parquet": write_parquet(files / "train.parquet", TRAIN),
                           "data/test-00000-of-00001.parquet": write_parquet(files / "test.parquet", TEST)},
             repo_type="dataset")
    (files / "README.md").write_text(GSM_README)
    add_repo(cache, GSM, {"README.md": files / "README.md",
                          "main/train-00000-of-00001.parquet": files / "train.parquet",
                          "main/test-00000-of-00001.parquet": files / "test.parquet",
                          "socratic/train-00000-of-00001.parquet": files / "test.parquet"}, repo_type="dataset")
    add_repo(cache, "colo-test/partial", {"data/train-00000-of-00001.parquet": files / "train.parquet"},
             repo_type="dataset", tree_extra={"data/train-00001-of-00002.parquet": 1234})
    return cache


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 set now (after huggingface_hub's import: colo.hub reads it per call), and the
    datasets library's Arrow cache in tmp_path."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


def rows(dataset) -> dict:
    return {"prompt": list(dataset["prompt"]), "answer": list(dataset["answer"])}


# -- telling hub ids from paths -------------------------------------------------------------------
def test_hub_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_hub_name("Qwen/Qwen2.5-0.5B-Instruct").repo_id == "Qwen/Qwen2.5-0.5B-Instruct"
    assert parse_hub_name("Qwen/Qwen2.5-0.5B-Instruct@refs/pr/3").revision == "refs/pr/3"
    name = parse_hub_name("openai/gsm8k@v1:main:train[:10]", dataset=True)
    assert (name.repo_id, name.revision, name.rest) == ("openai/gsm8k", "v1", "main:train[:10]")
    for path in ("/abs/org", "./org/name", "../org/name", "~/org", "name", "a/b/c", "org/name.jsonl",
                 "org/Data.PARQUET", "org/", "org/name@", "org/name:", "org/na--me", "org/name:test"):
        assert parse_hub_name(path, dataset=path != "org/name:test") is None, path
    assert parse_hub_name(Path("org/name")) is None  # a Path is always a path
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_name("org/name") is None  # a path that exists wins
    assert resolve_model("org/name") == Path("org/name")


# -- models ---------------------------------------------------------------------------------------
def test_model_from_the_offline_cache_loads_its_tokenizer(hub_cache, offline, smollm2_model_dir):
    from transformers import AutoTokenizer

    snapshot = hub_cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / commit_of(MODEL)
    path = resolve_model(MODEL, cache_dir=hub_cache)
    assert path.resolve() == snapshot.resolve()
    assert (path / "model.safetensors").is_symlink() and (path / "model.safetensors").resolve().parent.name == "blobs"
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert "<|im_start|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2 + 2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    original = AutoTokenizer.from_pretrained(smollm2_model_dir)
    assert tokenizer("What is 2 + 2?")["input_ids"] == original("What is 2 + 2?")["input_ids"]
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # A revision: the commit itself, or the branch through refs/; pinned() gives the commit.
    assert resolve_model(f"{MODEL}@{commit_of(MODEL)}", cache_dir=hub_cache) == path
    assert resolve_model(f"{MODEL}@main", cache_dir=hub_cache) == path
    assert pinned(MODEL, kind="model", cache_dir=hub_cache) == f"{MODEL}@{commit_of(MODEL)}"
    with pytest.raises(ValueError, match=r"and revision 'v2' is not in the Hugging Face cache at .* \(HF_HUB_OFF"):
        resolve_model(f"{MODEL}@v2", cache_dir=hub_cache)


def test_cache_and_offline_set_after_import_apply(hub_cache, offline, monkeypatch):
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_CACHE != str(hub_cache)  # read at import, before this test
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    assert resolve_model(MODEL).resolve() == (hub_cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots"
                                              / commit_of(MODEL)).resolve()


def test_local_model_directory_is_taken_as_it_is(smollm2_model_dir, tmp_path):
    assert resolve_model(str(smollm2_model_dir)) == Path(smollm2_model_dir)
    with pytest.raises(ValueError, match="no such directory"):
        resolve_model(str(tmp_path / "nothing"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="a file, not a model directory"):
        resolve_model(str(tmp_path / "config.json"))


def test_model_not_in_the_cache_says_so(hub_cache, offline):
    with pytest.raises(ValueError) as info:
        resolve_model("Foo/bar", cache_dir=hub_cache)
    assert str(info.value) == (f"Foo/bar: not a local directory, and not in the Hugging Face cache at {hub_cache} "
                               "(HF_HUB_OFFLINE=1)")
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        resolve_model(DATA, cache_dir=hub_cache)  # a dataset repo is not a model repo


def test_the_hubs_answers_become_one_clear_error(monkeypatch, offline, hub_cache):
    """What snapshot_download raises when online (a missing repo, a gated one, a missing revision, no
    connection), from a stand-in: the tests never reach the network (HF_HUB_OFFLINE=1 stays set)."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    import colo.hub

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/Foo/bar"))
    asked = []

    def answer(error):
        def snapshot_download(repo_id, **kwargs):
            asked.append((repo_id, kwargs))
            raise error
        return snapshot_download

    monkeypatch.setattr(colo.hub, "offline", lambda: False)
    unreachable = LocalEntryNotFoundError("Got: ConnectError")
    unreachable.__cause__ = ConnectionError("Name or service not known")
    for error, message in [
            (RepositoryNotFoundError("404", response=response), "Foo/bar: not a local directory, and not a model on "
             "the Hugging Face hub (nor a private one you can see"),
            (GatedRepoError("403", response=response), "the model Foo/bar on the Hugging Face hub is gated"),
            (RevisionNotFoundError("404", response=response), "the model Foo/bar on the Hugging Face hub has no "
             "revision 'v9'"),
            (unreachable, f"not in the Hugging Face cache at {hub_cache}, and the Hugging Face hub cannot be reached "
             "(ConnectionError: Name or service not known)")]:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", answer(error))
        spec = "Foo/bar@v9" if isinstance(error, RevisionNotFoundError) else "Foo/bar"
        with pytest.raises(ValueError) as info:
            resolve_model(spec, cache_dir=hub_cache)
        assert message in str(info.value)
        assert info.value.__cause__ is error
    assert asked[0] == ("Foo/bar", dict(repo_type="model", revision=None, cache_dir=str(hub_cache),
                                        local_files_only=False, ignore_patterns=colo.hub.MODEL_IGNORE))
    assert asked[2][1]["revision"] == "v9"
    monkeypatch.setattr(huggingface_hub, "snapshot_download", answer(RepositoryNotFoundError("404", response=response)))
    with pytest.raises(ValueError, match="dataset Foo/bar:test: not a local file or directory, and not a dataset"):
        load_dataset_spec("Foo/bar:test", cache_dir=hub_cache)
    assert asked[-1][1]["repo_type"] == "dataset" and asked[-1][1]["ignore_patterns"] is None


# -- datasets -------------------------------------------------------------------------------------
def test_dataset_splits_from_the_offline_cache(hub_cache, offline):
    assert rows(load_dataset_spec(f"{DATA}:test", cache_dir=hub_cache)) == TEST
    assert rows(load_dataset_spec(DATA, cache_dir=hub_cache)) == TRAIN  # default split: train
    assert rows(load_dataset_spec(f"{DATA}:train[:2]", cache_dir=hub_cache)) == {k: v[:2] for k, v in TRAIN.items()}
    with pytest.raises(ValueError, match=r"has no split 'validation' \(its splits: (train, test|test, train)\)"):
        load_dataset_spec(f"{DATA}:validation", cache_dir=hub_cache)
    pin = pinned(f"{DATA}:test", kind="dataset", cache_dir=hub_cache)
    assert pin == f"{DATA}@{commit_of(DATA)}:test"
    assert rows(load_dataset_spec(pin, cache_dir=hub_cache)) == TEST


def test_dataset_configs_as_in_gsm8k(hub_cache, offline):
    assert rows(load_dataset_spec(f"{GSM}:main:test", cache_dir=hub_cache)) == TEST
    assert rows(load_dataset_spec(f"{GSM}:socratic:train", cache_dir=hub_cache)) == TEST
    assert rows(load_dataset_spec(f"{GSM}:main", cache_dir=hub_cache)) == TRAIN  # "main" is a config here
    with pytest.raises(ValueError, match=f"has configs main, socratic and no default; name one, e.g. {GSM}:main:train"):
        load_dataset_spec(f"{GSM}:train", cache_dir=hub_cache)
    with pytest.raises(ValueError, match=r"has no config 'mian' \(it has main, socratic\)"):
        load_dataset_spec(f"{GSM}:mian:train", cache_dir=hub_cache)
    with pytest.raises(ValueError, match=r"config 'socratic' has no split 'test' \(its splits: train\)"):
        load_dataset_spec(f"{GSM}:socratic:test", cache_dir=hub_cache)


def test_dataset_not_found_and_missing_paths(hub_cache, offline, tmp_path, monkeypatch):
    with pytest.raises(ValueError) as info:
        load_dataset_spec("colo-test/absent:test", cache_dir=hub_cache)
    assert str(info.value) == ("dataset colo-test/absent:test: not a local file or directory, and not in the Hugging "
                               f"Face cache at {hub_cache} (HF_HUB_OFFLINE=1)")
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        load_dataset_spec(MODEL, cache_dir=hub_cache)  # a model repo is not a dataset repo
    for path in ("colo-test/prompts.jsonl", str(tmp_path / "absent.parquet"), "./colo-test/prompts"):
        with pytest.raises(ValueError, match="no such file or directory"):
            load_dataset_spec(path, cache_dir=hub_cache)
    # The cached listing names a file the snapshot lacks (an interrupted download).
    with pytest.raises(ValueError, match=r"holds only part of colo-test/partial .*missing \(data/train-00001-of"):
        load_dataset_spec("colo-test/partial", cache_dir=hub_cache)


def test_local_dataset_paths_are_read_as_before(hub_cache, offline, tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)
    datasets.Dataset.from_dict({"prompt": ["local"], "answer": ["0"]}).save_to_disk("colo-test/prompts")
    # An existing directory named like a hub id is that directory, not the hub's dataset of that name.
    assert rows(load_dataset_spec(DATA, cache_dir=hub_cache)) == {"prompt": ["local"], "answer": ["0"]}
    path = write_parquet(tmp_path / "t.parquet", TEST)
    assert rows(load_dataset_spec(str(path))) == TEST


# -- as a user runs it: only environment variables, set before anything is imported ---------------
def test_environment_variables_alone_in_a_fresh_process(hub_cache, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"),
               HF_HOME=str(tmp_path / "hf-home"))
    code = f"""
import json
from colo.hub import load_dataset_spec, resolve_model
import huggingface_hub.constants as c
out = {{"offline": c.HF_HUB_OFFLINE, "model": str(resolve_model({MODEL!r})),
       "test": list(load_dataset_spec({DATA + ':test'!r})["prompt"])}}
try:
    resolve_model("Foo/bar")
except ValueError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["offline"] is True
    assert Path(out["model"]).resolve() == (hub_cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots"
                                            / commit_of(MODEL)).resolve()
    assert out["test"] == TEST["prompt"]
    assert out["error"] == (f"Foo/bar: not a local directory, and not in the Hugging Face cache at {hub_cache} "
                            "(HF_HUB_OFFLINE=1)")


def test_the_cli_takes_hub_names_and_run_json_pins_them(hub_cache, offline, monkeypatch, tmp_path, capsys):
    """`python -m colo.grpo --model ORG/NAME --dataset ORG/NAME:SPLIT`: resolved from the cache before
    any engine starts, pinned to their commits for --resume; a name in neither place is one clear error."""
    from colo.grpo import cli

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    parser = cli.build_parser()
    argv = ["--steps", "1", "--json", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "out"), "--model", MODEL,
            "--dataset", f"{DATA}:test", "--eval-dataset", DATA, "--reward", "math"]
    args = cli.parse_args(parser, argv)
    model_dir, _, _ = cli._settings(args, parser)
    assert (model_dir / "config.json").is_file() and model_dir.name == commit_of(MODEL)
    assert args.model == f"{MODEL}@{commit_of(MODEL)}"
    assert cli.task_settings(args)["dataset"] == f"{DATA}@{commit_of(DATA)}:test"
    assert cli.task_settings(args)["eval_dataset"] == f"{DATA}@{commit_of(DATA)}"

    args = cli.parse_args(parser, [*argv[:7], "colo-test/not-there"])
    with pytest.raises(SystemExit):
        cli._settings(args, parser)
    assert "--model colo-test/not-there: not a local directory, and not in the Hugging Face cache" in \
        capsys.readouterr().err
