"""colo.hf_format and `python -m colo.grpo.export` without an engine: what a saved directory holds
(the tokenizer, chat template and generation config of a real model), LoRA merged as PEFT merges it,
masters reassembled from ZeRO shards, and bad input refused by name. The runs' own OUT/final are
tested with their runs (test_grpo_run.py, test_grpo_lora.py)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from colo.errors import CheckpointError
from colo import hf_format
from colo.lora import LoraSpec

from conftest import tiny_hf_model
from helpers.forked import run_python

REPO = Path(__file__).resolve().parents[2]


def test_a_saved_model_carries_the_tokenizer_chat_template_and_generation_config(smollm2_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(smollm2_model_dir, dtype=torch.float32)
    out = hf_format.write_model(base.state_dict(), smollm2_model_dir, tmp_path / "final", torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    original, saved = AutoTokenizer.from_pretrained(smollm2_model_dir), AutoTokenizer.from_pretrained(out)
    assert saved.apply_chat_template(messages, add_generation_prompt=True) == \
        original.apply_chat_template(messages, add_generation_prompt=True)
    assert saved.eos_token == original.eos_token
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, p in loaded.named_parameters():
        assert torch.equal(p, base.get_parameter(name).to(torch.bfloat16)), name
    assert not list(tmp_path.glob("*.writing"))


def test_merged_lora_is_what_peft_merges(tiny_model_dir, tmp_path):
    """The adapter as colo holds it (B in the slot's units: alpha/r x PEFT's) written as a PEFT adapter,
    and merged: PEFT loading the adapter onto the base and merging gives the same weights."""
    from peft import PeftModel

    from conftest import load_hf_model

    base_dir = tiny_model_dir("llama", vocab_size=777, tie_word_embeddings=False)
    spec = LoraSpec(4, alpha=8.0, targets=("q_proj", "down_proj"))
    torch.manual_seed(0)
    base = load_hf_model(base_dir)
    adapter = {}
    for name, module in base.named_modules():
        if name.rpartition(".")[2] in spec.targets:
            adapter[f"{name}.lora_A"] = torch.randn(spec.rank, module.in_features) * 0.1
            adapter[f"{name}.lora_B"] = torch.randn(module.out_features, spec.rank) * 0.1 * spec.scaling
    out = hf_format.write_adapter_dir(adapter, spec, base_dir, tmp_path / "final", merge=True)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    peft_merged = PeftModel.from_pretrained(load_hf_model(base_dir), out).merge_and_unload()
    ours = load_hf_model(out / "merged")
    changed = 0
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, peft_merged.get_parameter(name), atol=1e-6, rtol=0)
        changed += not torch.equal(p, base.get_parameter(name))
    assert changed == 2 * 2  # q_proj and down_proj of both layers


def test_masters_are_reassembled_from_every_ranks_shard():
    names = ["a", "b"]
    shapes = {"a": torch.Size([2, 3]), "b": torch.Size([4])}
    flat = torch.arange(10, dtype=torch.float32)
    shards = [{"ranges": torch.tensor([[0, 5]]), "master_weights": flat[:5]},
              {"ranges": torch.tensor([[5, 10]]), "master_weights": flat[5:]}]
    masters = hf_format.master_weights(shards, names, shapes)
    assert torch.equal(masters["a"], flat[:6].view(2, 3)) and torch.equal(masters["b"], flat[6:])
    assert torch.equal(hf_format.master_weights({"master_weights": flat}, names, shapes)["b"], flat[6:])
    assert hf_format.master_weights({"state": {}, "param_groups": []}, names, shapes) is None  # fp32: no masters
    with pytest.raises(CheckpointError, match="do not cover every master weight"):
        hf_format.master_weights(shards[:1], names, shapes)
    with pytest.raises(CheckpointError, match="not this model's optimizer"):
        hf_format.master_weights({"master_weights": flat[:9]}, names, shapes)


def test_a_failed_save_leaves_the_directory_that_was_there(tmp_path):
    from colo.files import staged_directory

    final = tmp_path / "final"
    with staged_directory(final) as staging:
        (staging / "model.safetensors").write_text("first")
    with pytest.raises(OSError):
        with staged_directory(final) as staging:
            (staging / "model.safetensors").write_text("second, half written")
            raise OSError("disk full")
    assert (final / "model.safetensors").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def _export(*args: str) -> subprocess.CompletedProcess:
    return run_python("colo.grpo.export", list(args), dict(os.environ), cwd=REPO, timeout=120)


def test_bad_input_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'int8' is not a dtype colo saves in"):
        hf_format.save_dtype("int8")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"--out {blocker / 'out'}: cannot write there"):
        hf_format.check_writable(blocker / "out")

    not_a_checkpoint = tmp_path / "step-000001.pt"
    not_a_checkpoint.write_text("{}")
    done = _export(str(not_a_checkpoint), "-o", str(tmp_path / "x"))
    assert done.returncode == 2 and "is not a colo GRPO checkpoint" in done.stderr, done.stderr
    done = _export(str(tmp_path), "-o", str(tmp_path / "x"), "--save-dtype", "fp8")
    assert done.returncode == 2 and "'fp8' is not a dtype" in done.stderr, done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = _export(str(empty), "-o", str(tmp_path / "x"))
    assert done.returncode == 2 and f"{empty} holds no checkpoint" in done.stderr, done.stderr
    assert not (tmp_path / "x").exists()


def test_a_full_fine_tuning_checkpoint_exports_and_refuses_merge_lora(tiny_model_dir, tmp_path):
    """A checkpoint as an fp32 run writes it (no masters: the weights are them)."""
    from colo.grpo import GRPOConfig
    from colo.grpo.checkpoint import save_checkpoint

    base_dir = tiny_model_dir("qwen2")
    model = tiny_hf_model("qwen2", seed=3)
    state = {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "rng": [{}],
             "config": GRPOConfig(dtype="fp32").to_dict(), "model_dir": str(base_dir),
             "param_names": [n for n, _ in model.named_parameters()]}
    save_checkpoint(tmp_path, 3, state)
    done = _export(str(tmp_path), "-o", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-2000:]
    from conftest import load_hf_model

    loaded = load_hf_model(tmp_path / "hf")
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in loaded.named_parameters())
    done = _export(str(tmp_path), "-o", str(tmp_path / "merged"), "--merge-lora")
    assert done.returncode == 2 and "is a full fine-tuning checkpoint" in done.stderr, done.stderr


def test_cli_refuses_bad_output_settings_before_anything_loads(tmp_path, capsys, monkeypatch):
    from colo.grpo import cli, trackers

    def error(argv) -> str:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        return capsys.readouterr().err

    base = ["--steps", "2", "--json", str(tmp_path / "log.jsonl")]
    assert "'fp8' is not a dtype" in error([*base, "--out", str(tmp_path / "o"), "--save-dtype", "fp8"])
    assert "--merge-lora needs --lora-rank > 0" in error([*base, "--out", str(tmp_path / "o"), "--merge-lora"])
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert f"--out {blocker / 'out'}: cannot write there" in error([*base, "--out", str(blocker / "out")])
    assert not (blocker.parent / "o").exists()  # a refused command creates nothing
    assert "--report-to mlflow: unknown tracker" in error([*base, "--out", str(tmp_path / "o"), "--report-to", "mlflow"])
    monkeypatch.setattr(trackers, "_installed", lambda name: name != "wandb")
    assert "the wandb package is not installed; pip install 'colo[wandb]'" in error(
        [*base, "--out", str(tmp_path / "o"), "--report-to", "tensorboard", "--report-to", "wandb"])
