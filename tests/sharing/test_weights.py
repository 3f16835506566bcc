"""colo.share_weights: one copy of the weights, training unchanged, publish() == a fresh engine."""
from __future__ import annotations

import copy
import os
import textwrap
from pathlib import Path

import pytest
import torch

import colo
from colo.engine import engine_model
from conftest import PROMPTS, load_hf_model, tiny_hf_model
from helpers.forked import run_python, run_python_ranks
from helpers.grpo_runs import failure_report
from helpers.logprobs import trainer_logprobs

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]  # where the helpers package is

# (architecture, config, trainer dtype, engine dtype, alias, tolerance on log-probabilities)
CASES = {
    "qwen2-tied-bias-vocab1000": ("qwen2", dict(vocab_size=1000, tie_word_embeddings=True), "float32", "float32",
                                  True, 1e-4),
    "llama-untied-vocab777": ("llama", dict(vocab_size=777, tie_word_embeddings=False), "float32", "float32",
                              True, 1e-4),
    "qwen3-untied-qknorm": ("qwen3", dict(vocab_size=640, tie_word_embeddings=False), "float32", "float32",
                            True, 1e-4),
    "llama-fp32-trainer-bf16-engine": ("llama", dict(vocab_size=777, tie_word_embeddings=True), "float32",
                                       "bfloat16", True, 2e-2),
    "qwen2-copy-path-forced": ("qwen2", dict(vocab_size=1000, tie_word_embeddings=False), "float32", "float32",
                               False, 1e-4),
}


def train_steps(model, optimizer, steps=2, seed=0):
    """A few real optimizer steps of next-token loss on random sequences."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 12), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.cpu_kind
@pytest.mark.parametrize("case", list(CASES))
def test_publish_matches_a_fresh_engine_from_save_pretrained(case, tmp_path, tiny_model_dir, build_engine,
                                                             prompt_logprobs):
    arch, config, trainer_dtype, engine_dtype, alias, tol = CASES[case]
    path = tiny_model_dir(arch, **config)
    llm = build_engine(path, dtype=engine_dtype)
    served_before = prompt_logprobs(llm)
    hf = load_hf_model(path, getattr(torch, trainer_dtype))
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-2)  # built before sharing: must keep working

    shared = colo.share_weights(hf, llm, alias=alias)
    torch.testing.assert_close(prompt_logprobs(llm), served_before, atol=tol, rtol=0)
    for _ in range(2):
        train_steps(hf, optimizer)
        report = shared.publish()
        if trainer_dtype == engine_dtype and alias:
            assert report["bytes_copied"] == 0
        else:
            itemsize = torch.empty((), dtype=getattr(torch, engine_dtype)).element_size()
            assert report["bytes_copied"] == sum(p.numel() for p in hf.parameters()) * itemsize
    served_after = prompt_logprobs(llm)
    assert (served_after - served_before).abs().max() > max(0.1, 10 * tol), "the update should change outputs"

    hf.save_pretrained(tmp_path / "updated")
    fresh = build_engine(tmp_path / "updated", dtype=engine_dtype)
    torch.testing.assert_close(served_after, prompt_logprobs(fresh), atol=tol, rtol=0)


def test_shared_model_is_a_view_of_the_engine_tensors_which_never_move(tiny_model_dir, build_engine,
                                                                         prompt_logprobs):
    pool = colo.Pool("cpu")
    path = tiny_model_dir("qwen2", vocab_size=1000, tie_word_embeddings=True)
    llm = build_engine(path, pool=pool)
    model = engine_model(llm)
    addresses = {name: p.data_ptr() for name, p in model.named_parameters()}
    served = prompt_logprobs(llm)
    weights = pool.regions["weights"]
    allocated = weights.stats()["allocated_bytes"]

    shared = colo.shared_model(llm)
    hf = shared.hf_model
    assert shared.shared_once_bytes == 0 and shared.copy_bytes == 0
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == addresses, "engine tensors moved"
    assert weights.stats()["allocated_bytes"] == allocated, "sharing allocated weights"
    for name, param in hf.named_parameters():
        assert weights.contains(param), f"{name} is outside the weights region"
    # HF q/k/v and gate/up are consecutive row ranges of the engine's fused tensors.
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    qkv, gate_up = model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].mlp.gate_up_proj
    assert attn.q_proj.weight.data_ptr() == qkv.weight.data_ptr()
    assert attn.k_proj.weight.data_ptr() == qkv.weight[128:].data_ptr()
    assert attn.v_proj.weight.data_ptr() == qkv.weight[192:].data_ptr()
    assert attn.v_proj.bias.data_ptr() == qkv.bias[192:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up.weight[256:].data_ptr()
    # The embedding is the first 1000 rows of the engine's padded 1024; tied stays tied on both sides.
    assert tuple(model.model.embed_tokens.weight.shape) == (1024, 128)
    assert hf.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert shared.aliased_bytes == sum(p.numel() * p.element_size() for p in hf.parameters())
    assert hf.training and all(p.requires_grad for p in hf.parameters())
    # The trainer's model computes what the engine serves (its rotary buffers were computed, not loaded).
    expected = trainer_logprobs(hf, [PROMPTS[0]], torch.float64)
    torch.testing.assert_close(served[:len(expected)], expected, atol=1e-4, rtol=0)

    # Sharing a loaded model writes its values into the same tensors; the earlier handle is superseded.
    loaded = load_hf_model(tiny_model_dir("qwen2", vocab_size=1000, tie_word_embeddings=True, seed=1))
    again = colo.share_weights(loaded, llm)
    assert again.shared_once_bytes == again.aliased_bytes > 0
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == addresses
    assert hf.model.embed_tokens.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(hf.model.norm.weight, loaded.model.norm.weight, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="later colo.share_weights"):
        shared.publish()
    assert again.publish()["bytes_copied"] == 0


RSS_SCRIPT = """
import gc, os, sys, torch
import colo
from colo.engine import build_llm
from colo.vllm_compat.forced_kernels import forced_cpu_gemm

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

path, how = sys.argv[1], sys.argv[2]
with forced_cpu_gemm("plain"):  # no kernel-private packed copies: the weights are the only copy
    llm = build_llm(path, colo.Pool("cpu"), dtype="float32", kv_cache_bytes=4 << 20, max_model_len=256,
                    skip_tokenizer_init=True, enforce_eager=True)
weight_bytes = colo.engine.weights_region(llm).stats()["allocated_bytes"]
gc.collect()
before = rss()
if how == "shared_model":
    # No log-probability check here: its generation is the engine's first, and vLLM's runtime buffers
    # (about 43 MB here) would be counted as the trainer's.
    model = colo.shared_model(llm, check_logprobs=False).hf_model
else:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
with torch.no_grad():  # touch every weight, as training does (transformers may map the file lazily)
    sum(float(p.sum()) for p in model.parameters())
gc.collect()
print(f"RESULT {weight_bytes} {rss() - before}", flush=True)
"""


@pytest.mark.parametrize("how", ["shared_model", "from_pretrained"])
def test_the_trainer_model_adds_no_copy_of_the_weights(how, tmp_path, tiny_model_dir):
    """Measured RSS: colo.shared_model adds nothing, where loading the trainer's own model adds a
    second copy (the control, showing the measurement can see one)."""
    path = tiny_model_dir("llama", vocab_size=32000, tie_word_embeddings=False, hidden_size=256,
                          intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    done = run_python(script, [str(path), how], env, cwd=tmp_path, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    weight_bytes, grown = map(int, lines[0].split()[1:])
    assert weight_bytes > 40 << 20
    if how == "shared_model":
        assert grown < 0.1 * weight_bytes, (grown, weight_bytes)
    else:
        assert grown > 0.9 * weight_bytes, (grown, weight_bytes)


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.AdamW(params, lr=1e-2),
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
], ids=["adamw", "sgd-momentum"])
def test_training_is_unchanged_by_sharing(make_optimizer, tiny_model_dir, tiny_engine):
    hf = load_hf_model(tiny_model_dir("qwen2"))
    twin = copy.deepcopy(hf)  # never shared
    optimizer, twin_optimizer = make_optimizer(hf.parameters()), make_optimizer(twin.parameters())
    colo.share_weights(hf, tiny_engine)
    train_steps(hf, optimizer, steps=3)
    train_steps(twin, twin_optimizer, steps=3)
    for (name, a), (_, b) in zip(hf.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"{name} diverged")


def test_publish_resets_the_prefix_cache(tiny_model_dir, tiny_engine):
    from vllm import SamplingParams

    hf = load_hf_model(tiny_model_dir("qwen2"))
    shared = colo.share_weights(hf, tiny_engine)
    prompt = {"prompt_token_ids": list(range(1, 200))}  # longer than a KV block, so prefixes get cached
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def cached_tokens():
        return tiny_engine.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens

    cached_tokens()
    assert cached_tokens() > 0, "the second identical request should hit the prefix cache"
    shared.publish()
    assert cached_tokens() == 0, "KV computed with the old weights must not be reused"


def test_publish_refuses_parameters_moved_after_sharing(tiny_model_dir, tiny_engine):
    hf = load_hf_model(tiny_model_dir("qwen2"))
    shared = colo.share_weights(hf, tiny_engine)
    assert shared.moved_parameters() == []
    hf.to(torch.float64)  # gives every parameter new storage the engine cannot see
    assert "model.embed_tokens.weight" in shared.moved_parameters()
    with pytest.raises(RuntimeError, match="model.embed_tokens.weight was given new storage after colo.share_weights"):
        shared.publish()
    assert shared.publish_count == 0  # refused before anything was counted as served


# A model that does not fit the engine (a tied fp32 Qwen2 with vocab 1000), and the parameter named.
BAD_MODELS = {
    "wider-mlp": (lambda: tiny_hf_model("qwen2", intermediate_size=384), ValueError,
                  r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight"),
    "fewer-layers": (lambda: tiny_hf_model("qwen2", num_hidden_layers=1), ValueError, r"model\.layers\.1\."),
    "more-layers": (lambda: tiny_hf_model("qwen2", num_hidden_layers=3), ValueError, r"model\.layers\.2\."),
    "other-vocab-same-padding": (lambda: tiny_hf_model("qwen2", vocab_size=1010), ValueError,
                                 r"model\.embed_tokens\.weight"),
    "untied": (lambda: tiny_hf_model("qwen2", tie_word_embeddings=False), ValueError, r"lm_head\.weight"),
    "other-family": (lambda: tiny_hf_model("llama"), ValueError, "model type: the Hugging Face model is a llama"),
    "other-norm-eps": (lambda: tiny_hf_model("qwen2", rms_norm_eps=1e-3), ValueError, r"config\.rms_norm_eps"),
    "no-such-family-in-the-engine": (lambda: _tiny_gpt2(), ValueError, "is a gpt2"),
    "not-a-model": (lambda: {"model.embed_tokens.weight": torch.zeros(1000, 128)}, TypeError, "dict"),
}


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=2, n_positions=256))


@pytest.fixture(scope="module")
def known_engine(tiny_model_dir, build_engine):
    """A private Qwen2 engine whose weights no test changes (bad inputs must leave it alone)."""
    return build_engine(tiny_model_dir("qwen2"))


@pytest.mark.parametrize("bad", list(BAD_MODELS))
def test_bad_model_is_refused_and_the_engine_keeps_serving(bad, known_engine, prompt_logprobs):
    make, error, named = BAD_MODELS[bad]
    model = engine_model(known_engine)
    before = prompt_logprobs(known_engine)
    params_before = {name: (p, p.data_ptr(), p.shape) for name, p in model.named_parameters()}
    linears_before = {name: m.cpu_linear for name, m in model.named_modules() if hasattr(m, "cpu_linear")}

    with pytest.raises(error, match=named):
        colo.share_weights(make(), known_engine)

    after = {name: (p, p.data_ptr(), p.shape) for name, p in model.named_parameters()}
    assert after.keys() == params_before.keys()
    for name, (param, ptr, shape) in params_before.items():
        assert after[name][0] is param and after[name][1] == ptr and after[name][2] == shape, name
    assert {n: m.cpu_linear for n, m in model.named_modules() if hasattr(m, "cpu_linear")} == linears_before
    torch.testing.assert_close(prompt_logprobs(known_engine), before, atol=0, rtol=0)


@pytest.fixture
def foreign_engine():
    """Factory: foreign_engine(path, enforce_eager) -> a vllm.LLM built the stock way, not by colo (in
    this process: conftest disables multiprocessing). Released after the test: collected later, its
    shutdown would tear down vLLM's process groups under whichever engine is running then."""
    from vllm import LLM

    from colo.engine import release_llm

    built = []

    def build(path, enforce_eager: bool):
        built.append(LLM(model=str(path), dtype="float32", seed=0, max_model_len=256, skip_tokenizer_init=True,
                         kv_cache_memory_bytes=16 << 20, enforce_eager=enforce_eager))
        return built[-1]

    yield build
    for llm in built:
        release_llm(llm)


def test_an_eager_engine_colo_did_not_build_is_moved_into_a_pool_and_shared(tmp_path, tiny_model_dir, build_engine,
                                                                             foreign_engine, prompt_logprobs):
    path = tiny_model_dir("qwen2", vocab_size=1000, tie_word_embeddings=False)
    llm = foreign_engine(path, enforce_eager=True)
    hf = load_hf_model(path)
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    pool = colo.Pool("cpu")
    shared = colo.share_weights(hf, llm, pool=pool)
    for name, param in engine_model(llm).named_parameters():
        assert pool.regions["weights"].contains(param), name
    train_steps(hf, optimizer)
    assert shared.publish()["bytes_copied"] == 0
    hf.save_pretrained(tmp_path / "updated")
    torch.testing.assert_close(prompt_logprobs(llm), prompt_logprobs(build_engine(tmp_path / "updated")),
                               atol=1e-4, rtol=0)


def test_a_compiled_engine_colo_did_not_build_is_refused_unchanged(tiny_model_dir, foreign_engine, prompt_logprobs):
    path = tiny_model_dir("qwen2", vocab_size=1000, tie_word_embeddings=False)
    llm = foreign_engine(path, enforce_eager=False)
    before = prompt_logprobs(llm)
    addresses = [p.data_ptr() for p in engine_model(llm).parameters()]
    with pytest.raises(RuntimeError, match="colo.engine.build_llm"):
        colo.share_weights(load_hf_model(path), llm)
    assert [p.data_ptr() for p in engine_model(llm).parameters()] == addresses
    torch.testing.assert_close(prompt_logprobs(llm), before, atol=0, rtol=0)


def test_bad_arguments_are_refused(tiny_model_dir, tiny_engine):
    hf = load_hf_model(tiny_model_dir("qwen2"))
    with pytest.raises(ValueError, match="bucket_bytes"):
        colo.share_weights(hf, tiny_engine, bucket_bytes=0)
    with pytest.raises(RuntimeError, match="in this process"):
        colo.share_weights(hf, object())


TORCHRUN_SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
import colo
from colo.engine import build_llm
from transformers import AutoModelForCausalLM
from vllm import SamplingParams

from helpers.logprobs import trainer_logprobs  # tests/ is on PYTHONPATH

path, tp = sys.argv[1], int(sys.argv[2])
llm = build_llm(path, dtype="float32", kv_cache_bytes=16 << 20, max_model_len=256, skip_tokenizer_init=True,
                tensor_parallel_size=tp)
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
shared = colo.share_weights(hf, llm)
optimizer = torch.optim.SGD(hf.parameters(), lr=0.5)
ids = torch.tensor([PROMPT])
hf(input_ids=ids, labels=ids).loss.backward()
optimizer.step()
report = shared.publish()
out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
served = torch.tensor([e[t].logprob for t, e in zip(PROMPT[1:], out[0].prompt_logprobs[1:])])
err = (served - trainer_logprobs(hf, [PROMPT])).abs().max().item()
print(f"RANK {dist.get_rank()} bytes_copied={report['bytes_copied']} max_err={err}", flush=True)
assert err < 1e-4, err
# Both ranks done before either tears down its engine (as colo.grpo leaves the world on the way out).
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("tp", [2])
def test_each_rank_shares_its_own_tensor_parallel_shard(tp, tmp_path, tiny_model_dir):
    path = tiny_model_dir("llama", vocab_size=777, tie_word_embeddings=False)
    script = tmp_path / "share_on_each_rank.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT).replace("PROMPT", repr(list(PROMPTS[0]))))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    run = run_python_ranks(script, [str(path), str(tp)], env, ranks=2, cwd=tmp_path, timeout=400)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RANK")]
    assert run.returncode == 0 and len(lines) == 2, run.stdout[-2000:] + failure_report(run.stderr)
    # Tensor-parallel shards cannot alias the full trainer tensors: each rank copies its own shard.
    assert all("bytes_copied=0" not in line for line in lines)
