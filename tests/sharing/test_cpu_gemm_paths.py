"""Every CPU GEMM kernel vLLM may pick, forced on this machine, with fp32 and bf16 engines, compiled as
vLLM runs by default: the trainer shares the engine's weights, trains, publishes, and the engine
then serves exactly what a fresh engine built from the saved weights serves on the same kernel.

vLLM picks per layer and CPU kind (colo.vllm_compat.forced_kernels.forced_cpu_gemm): AMX machines take sgl-kernel
for small bf16 weights and oneDNN for the rest, AVX-512 machines oneDNN, AVX2 machines oneDNN for
fp32 and F.linear ("plain") for bf16 (their oneDNN refuses it), and F.linear when neither applies.
Forcing each here covers the other machine kinds in CI; what vLLM then uses is asked of the vLLM
build in use (forced_kernel_outcome), never a table per CPU kind. The sgl kernels exist only in
vLLM's AVX-512-BF16 build, so on an AVX2-only CPU (or its persona, colo.cpu_persona) that case
cannot run: it is skipped there with the reason, and runs on every AVX-512-BF16 or AMX machine.
"""
from __future__ import annotations

import pytest
import torch

import colo
from colo.engine import cpu_kernels, engine_model
from colo.vllm_compat.forced_kernels import sgl_unavailable_reason
from conftest import PROMPTS
from helpers.cpu_gemm import forced_kernel_outcome

pytestmark = [pytest.mark.slow, pytest.mark.cpu_kind]

# (kernel forced, engine dtype)
CASES = [(kernel, dtype) for kernel in ("sgl", "onednn", "plain") for dtype in ("bfloat16", "float32")]
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def greedy_tokens(llm):
    from vllm import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS],
                           SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("kernel,dtype", CASES, ids=[f"{k}-{d}" for k, d in CASES])
def test_compiled_engine_serves_the_trained_weights_on_every_kernel(kernel, dtype, tmp_path, tiny_model_dir,
                                                                   build_engine, prompt_logprobs):
    if kernel == "sgl" and sgl_unavailable_reason():
        pytest.skip(sgl_unavailable_reason())
    path = tiny_model_dir("qwen2", vocab_size=1000, tie_word_embeddings=True)  # q/k/v biases: sgl makes them fp32
    llm = build_engine(path, dtype=dtype, kernel=kernel, enforce_eager=False)
    used = forced_kernel_outcome(kernel, getattr(torch, dtype))
    assert set(cpu_kernels(llm)) == {used}
    addresses = {name: p.data_ptr() for name, p in engine_model(llm).named_parameters()}
    before = prompt_logprobs(llm)

    shared = colo.shared_model(llm)
    hf = shared.hf_model
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 1000, (2, 12), generator=generator)
        hf(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report = shared.publish()
        assert (report["bytes_repacked"] > 0) == (used != "plain")
        # Biases the sgl kernel keeps in fp32 cannot alias a bf16 trainer: they, and only they, are copied.
        assert report["bytes_copied"] == (sum(p.numel() * 4 for n, p in hf.named_parameters() if n.endswith("bias"))
                                          if used == "sgl" else 0)
    assert {name: p.data_ptr() for name, p in engine_model(llm).named_parameters()} == addresses
    served = prompt_logprobs(llm)
    assert (served - before).abs().max() > 0.1, "the update should change what the engine serves"

    hf.save_pretrained(tmp_path / "trained")
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    aot_compiles, cache_misses = compilation_counter.num_aot_compiles, counters["inductor"]["fxgraph_cache_miss"]
    fresh = build_engine(tmp_path / "trained", dtype=dtype, kernel=kernel, enforce_eager=False)
    # The same model compiled moments ago: its compiled code loads from the compile cache instead of
    # being compiled again (colo.vllm_compat.version.use_loadable_compile_cache).
    assert compilation_counter.num_aot_compiles == aot_compiles
    assert counters["inductor"]["fxgraph_cache_miss"] == cache_misses
    assert greedy_tokens(llm) == greedy_tokens(fresh)
    torch.testing.assert_close(served, prompt_logprobs(fresh), atol=TOLERANCE[dtype], rtol=0)
