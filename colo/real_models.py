"""What colo.smollm2 and colo.gemma3 share: a GGUF file converted offline to a Hugging Face model
directory (fp32 safetensors, config, tokenizer), cached in $COLO_CACHE (default ~/.cache/colo) and
written beside the target then renamed, so concurrent first uses (pytest workers, torchrun ranks)
never see half a model; they take turns on a lock file beside it, so one converts and the others wait
for its result instead of each converting again."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("COLO_CACHE") or Path.home() / ".cache" / "colo")


def converted(target: Path) -> bool:
    """Whether target already holds a finished conversion."""
    return (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file()


def gguf_field(gguf: Path, key: str):
    """A metadata field of the GGUF file (None where absent). transformers' metadata reader skips the
    token arrays, which gguf's GGUFReader parses one element at a time (all of Gemma 3's 262,144 tokens)."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:  # a transformers without it: the slow reader
        from gguf import GGUFReader

        field = GGUFReader(str(gguf)).fields.get(key)
        return None if field is None else field.contents()
    return read_gguf_metadata(str(gguf))[0].get(key)


def convert_gguf(gguf: Path, target: Path, architecture: str, chat_template: str | None = None) -> Path:
    """Dequantize the GGUF file to a model directory at target (left as it is where it is finished);
    chat_template is set where the GGUF carries none."""
    if converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(f"{target.name}.lock")):
        if converted(target):  # another process converted it while this one waited
            return target
        return _convert(gguf, target, architecture, chat_template)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert(gguf: Path, target: Path, architecture: str, chat_template: str | None) -> Path:
    """The conversion itself, written to a staging directory then renamed to target (a process killed
    midway leaves no half model at target)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    # transformers drops the GGUF's add_bos_token (Gemma's is true): without it the tokenizer, and vLLM
    # through it, would encode prompts with no BOS, which Gemma 3 answers with nonsense.
    if gguf_field(gguf, "tokenizer.ggml.add_bos_token"):
        tokenizer.add_bos_token = True
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized; a saved "quant_method: gguf" would make every later load look for
    # the GGUF file again.
    for holder in (model.config, getattr(model, "hf_quantizer", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.hf_quantizer = None
    model.config.architectures = [architecture]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target
