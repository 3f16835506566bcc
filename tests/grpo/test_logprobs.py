"""colo.grpo.logprobs: log-probabilities a chunk of tokens at a time equal the straightforward way's
(values and every parameter's gradient) up to float summation order, and keep no logits for backward;
a packed batch's log-probabilities (colo.grpo.batch) are each sequence's alone."""
import pytest
import torch
from conftest import tiny_hf_model

from colo.grpo.batch import completion_logprobs, pack
from colo.grpo.logprobs import completion_logprobs_chunked, full_logits_logprobs, has_plain_head
from helpers.models import one_layer_qwen2

EPS32 = torch.finfo(torch.float32).eps
VOCAB = 1000
# Left-padded prompts of different lengths, completions of different lengths: 3 x 11 = 33 positions.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
COMPLETION_LENGTHS = (11, 4, 9)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    completions = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in COMPLETION_LENGTHS]
    return pack(PROMPTS, completions)


def _args(model, batch, temperature):
    return model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids, temperature


def _run(fn, model, batch, temperature, **kwargs):
    """Log-probabilities and every parameter's gradient of a loss that weighs each token differently."""
    model.zero_grad(set_to_none=True)
    logprobs = fn(*_args(model, batch, temperature), **kwargs)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs) * batch.completion_mask
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def _value_tolerance(model, batch, temperature) -> float:
    """Largest |chunked - straightforward| of one log-probability from rounding alone. A logit is a dot
    product of length H accumulated in fp32, in an order the matmul's blocking picks: two orders differ
    by at most H eps32 sum_k |h_k w_k| <= H eps32 |h| |w| (Cauchy-Schwarz), and rounding to the model's
    dtype can then land one ulp apart (eps_dtype |z|, |z| <= |h| |w|). A log-probability is one logit
    minus a logsumexp, each moving by at most that over T, and the logsumexp's fp32 sum of V terms
    adds V eps32."""
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                     position_ids=batch.position_ids).last_hidden_state.float()
        weight = model.get_output_embeddings().weight.detach().float()
    dot = float(hidden.norm(dim=-1).max() * weight.norm(dim=-1).max())
    eps = torch.finfo(model.dtype).eps
    return 2 * (hidden.shape[-1] * EPS32 + eps) * dot / temperature + weight.shape[0] * EPS32


def _gradient_tolerance(model, tokens: int, chunks: int) -> float:
    """Largest |chunked - straightforward| of a gradient entry, relative to the largest entry of that
    gradient. Chunking re-associates sums: the logits' (H terms) and the hidden states' gradients
    (V terms per row) in fp32, and the head weight's gradient, a sum over the `tokens` positions,
    accumulated in fp32 within a chunk but across the `chunks` chunks in the parameter's dtype (autograd
    adds the chunks' gradients in it): chunks + 1 roundings there. Each sum of n terms is within
    n eps of its exact value, relative to the sum of its terms' magnitudes (Higham's gamma_n); the
    gradient's largest entry stands for that magnitude here (a normwise bound)."""
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    return (hidden + vocab + tokens) * EPS32 + (chunks + 1) * torch.finfo(model.dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("llama", False), ("qwen3", False)])
@pytest.mark.parametrize("chunk_tokens", [7, 1, 64])  # 33 positions: a ragged last chunk, one per chunk, one chunk
def test_chunked_equals_straightforward_values_and_gradients(dtype, arch, tied, chunk_tokens):
    model = tiny_hf_model(arch, vocab_size=VOCAB, tie_word_embeddings=tied, dtype=dtype)
    assert has_plain_head(model)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    batch, temperature = _batch(), 0.7
    full, full_grads = _run(full_logits_logprobs, model, batch, temperature)
    chunked, chunked_grads = _run(completion_logprobs_chunked, model, batch, temperature, chunk_tokens=chunk_tokens)

    assert chunked.dtype == torch.float32 and chunked.shape == batch.completion_ids.shape
    assert (chunked - full).abs().max() <= _value_tolerance(model, batch, temperature)
    tokens = batch.completion_ids.numel()
    relative = _gradient_tolerance(model, tokens, -(-tokens // chunk_tokens))
    assert full_grads.keys() == chunked_grads.keys()
    for name, expected in full_grads.items():
        assert expected.abs().max() > 0, name  # every parameter takes part
        assert (chunked_grads[name] - expected).abs().max() <= relative * expected.abs().max(), name


def test_without_gradients_values_match_and_nothing_is_kept():
    """The reference model's path (beta > 0): under no_grad, no checkpointing and no graph."""
    model = tiny_hf_model("qwen2", vocab_size=VOCAB)
    batch = _batch(1)
    with torch.no_grad():
        full = full_logits_logprobs(*_args(model, batch, 1.0))
        chunked = completion_logprobs_chunked(*_args(model, batch, 1.0), chunk_tokens=5)
    assert not chunked.requires_grad
    assert (chunked - full).abs().max() <= _value_tolerance(model, batch, 1.0)


def test_completion_logprobs_takes_the_chunked_way_for_plain_heads_only(monkeypatch):
    import colo.grpo.batch as batch_module

    calls = []
    monkeypatch.setattr(batch_module, "completion_logprobs_chunked",
                        lambda *a, **k: calls.append("chunked") or completion_logprobs_chunked(*a, **k))
    monkeypatch.setattr(batch_module, "full_logits_logprobs",
                        lambda *a, **k: calls.append("full") or full_logits_logprobs(*a, **k))
    model, batch = tiny_hf_model("llama", vocab_size=VOCAB), _batch()
    completion_logprobs(model, batch)
    assert calls == ["chunked"]
    # A model whose logits are not lm_head(hidden) alone: Gemma 2 soft-caps them.
    gemma = tiny_hf_model("gemma2", vocab_size=VOCAB)
    assert gemma.config.final_logit_softcapping and not has_plain_head(gemma)
    completion_logprobs(gemma, batch)
    assert calls == ["chunked", "full"]


def test_packed_batch_logprobs_match_each_sequence_alone():
    model = one_layer_qwen2()
    prompts, completions = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14]]
    batch = pack(prompts, completions)
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    together = completion_logprobs(model, batch, temperature=0.5)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1] / 0.5
        alone = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(together[row, :len(c)], alone, atol=1e-5)
    with pytest.raises(ValueError, match="prompts but"):
        pack(prompts, completions[:1])


def test_lora_adapter_trains_and_its_base_is_the_reference():
    """colo.lora's trainer model: adapter hooks on the decoder's linears (the head is not adapted), and
    its reference() (the base, adapter off inside model()'s block) as GRPO's KL reference; both go the
    chunked way and match the straightforward one."""
    from colo.lora import LoraSpec, SharedAdapter, _adapter_forward

    model = tiny_hf_model("qwen2", vocab_size=VOCAB)
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = SharedAdapter(LoraSpec(rank=4), llm=None, hf_model=model, request=None, slot=0)
    torch.manual_seed(1)
    for name in ("q_proj", "v_proj", "down_proj"):
        for module in (m for n, m in model.named_modules() if n.endswith(name)):
            module.register_parameter("lora_A", torch.nn.Parameter(torch.randn(4, module.in_features) * 0.1))
            module.register_parameter("lora_B", torch.nn.Parameter(torch.randn(module.out_features, 4) * 0.1))
            module.register_forward_hook(_adapter_forward(adapter, 0.0))
    batch, temperature = _batch(2), 0.9
    full, full_grads = _run(full_logits_logprobs, model, batch, temperature)
    chunked, chunked_grads = _run(completion_logprobs_chunked, model, batch, temperature, chunk_tokens=6)
    tokens = batch.completion_ids.numel()
    assert (chunked - full).abs().max() <= _value_tolerance(model, batch, temperature)
    relative = _gradient_tolerance(model, tokens, -(-tokens // 6))
    lora = [n for n in full_grads if "lora_" in n]
    assert lora and set(full_grads) == set(lora)  # only the adapter trains
    for name in lora:
        assert (chunked_grads[name] - full_grads[name]).abs().max() <= relative * full_grads[name].abs().max(), name

    reference = adapter.reference()
    with torch.no_grad():
        with reference.model() as reference_model:
            assert reference_model is model and not adapter.enabled
            ref = completion_logprobs(reference_model, batch, temperature)
        with adapter.disabled():
            base = full_logits_logprobs(*_args(model, batch, temperature))
    assert adapter.enabled  # back on after the reference's forward
    assert (ref - base).abs().max() <= _value_tolerance(model, batch, temperature)
    assert (ref - full).abs().max() > 1e-3  # the adapter was off: not the trained model's values


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while fn() runs: each storage once, the parameters not counted."""
    storages = {}

    def pack_hook(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        fn()
    return storages


@pytest.mark.parametrize("chunk_tokens", [4, 16])
def test_no_logits_are_kept_for_backward(chunk_tokens):
    """Without checkpointing each chunk's fp32 logits (33 x V x 4 bytes in all) would be saved for
    backward; with it, only the decoder's activations, and the completion positions' hidden states and
    targets, which backward recomputes the chunks from."""
    model = tiny_hf_model("qwen2", vocab_size=VOCAB)
    batch = _batch()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def kept(fn):
        return sum(n for ptr, n in _saved_bytes(fn).items() if ptr not in params)

    decoder = kept(lambda: model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                               position_ids=batch.position_ids))
    chunked = kept(lambda: completion_logprobs_chunked(*_args(model, batch, 1.0), chunk_tokens=chunk_tokens))
    full = kept(lambda: full_logits_logprobs(*_args(model, batch, 1.0)))
    tokens = batch.completion_ids.numel()
    assert full - decoder >= tokens * VOCAB * 4  # the straightforward way keeps at least the fp32 logits
    assert chunked - decoder <= tokens * (model.config.hidden_size * 4 + 8)  # fp32 hidden states, int64 targets


def test_chunk_tokens_must_be_positive():
    model = tiny_hf_model("qwen2", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="chunk_tokens"):
        completion_logprobs_chunked(*_args(model, _batch(), 1.0), chunk_tokens=0)


@pytest.mark.cpu_kind  # bf16 products differ between CPU kinds' kernels
def test_a_bf16_heads_gradient_is_summed_over_the_chunks_in_fp32():
    """128 chunks (8 x 4096 tokens at 256 a chunk, scaled down): the head weight's gradient against one
    fp64 sum of the same chunk products. Summed into the optimizer's fp32 main_grad it is that sum to
    fp32 rounding; without a main_grad it is summed in bf16, as autograd adds the chunks' gradients,
    several times further off than one bf16 rounding of the exact sum."""
    from colo.grpo.logprobs import ChunkedHead, _logprob_gradient

    torch.manual_seed(0)
    vocab, width, chunk, rows = 256, 64, 8, 8 * 128
    hidden = torch.randn(rows, width).to(torch.bfloat16)
    weight = torch.nn.Parameter((torch.randn(vocab, width) * 0.2).to(torch.bfloat16))
    targets = torch.randint(0, vocab, (rows,))
    upstream = torch.randn(rows)

    # The chunk products the chunked backward computes, then one fp64 sum of them.
    products = []
    for h, t, g in zip(hidden.split(chunk), targets.split(chunk), upstream.split(chunk)):
        grad_logits = _logprob_gradient(torch.nn.functional.linear(h, weight.detach()), t, g, 1.0)
        products.append(grad_logits.t() @ h)  # bf16, as on a CPU
    exact = torch.stack([p.double() for p in products]).sum(0)
    in_bf16 = torch.zeros_like(weight)
    for p in products:
        in_bf16 += p
    scale = float(exact.abs().max())

    ChunkedHead.apply(hidden, weight, None, targets, 1.0, chunk).backward(upstream)
    without_main_grad = weight.grad.double()
    weight.grad = None
    weight.main_grad = torch.zeros(vocab, width)  # as colo.MasterWeightOptimizer gives it
    ChunkedHead.apply(hidden, weight, None, targets, 1.0, chunk).backward(upstream)
    assert weight.grad is None  # went to main_grad only: nothing for autograd to add in bf16

    error = {name: float((value.double() - exact).abs().max()) / scale for name, value in
             (("main_grad", weight.main_grad), ("rounded once", exact.to(torch.bfloat16)),
              ("without main_grad", without_main_grad), ("bf16 sum", in_bf16))}
    assert error["main_grad"] < 1e-6, error                       # fp32 sum of the same products
    assert error["without main_grad"] == error["bf16 sum"], error  # autograd's way: a bf16 running sum
    assert error["bf16 sum"] > 4 * error["rounded once"], error   # several bf16 roundings of the exact sum


def test_an_untied_bf16_head_trains_through_the_master_weight_optimizers_main_grad(tiny_model_dir):
    """The head's gradient goes to its fp32 main_grad only (nothing for autograd to add): the optimizer's
    hook must take the head's empty gradient in stride, and the result is the full-logits gradient."""
    from colo import MasterWeightOptimizer
    from colo.grpo.logprobs import completion_logprobs_chunked, full_logits_logprobs

    from conftest import load_hf_model

    path = tiny_model_dir("llama", vocab_size=777, tie_word_embeddings=False)
    chunked_model, full_model = (load_hf_model(path, torch.bfloat16) for _ in range(2))
    optimizer = MasterWeightOptimizer(chunked_model.parameters(), torch.optim.AdamW)
    torch.manual_seed(0)
    ids = torch.randint(0, 777, (2, 48))
    args = (ids, torch.ones_like(ids), torch.arange(48).expand(2, -1), ids[:, 16:])
    completion_logprobs_chunked(chunked_model, *args, chunk_tokens=8).sum().backward()
    full_logits_logprobs(full_model, *args).sum().backward()
    head = next(i for i, p in enumerate(chunked_model.parameters()) if p is chunked_model.lm_head.weight)
    expected = full_model.lm_head.weight.grad.float()
    gap = (optimizer.main_grads[head] - expected).abs().max() / expected.abs().max()
    assert chunked_model.lm_head.weight.grad is None and gap < 2 ** -7
    optimizer.step()  # and it steps
