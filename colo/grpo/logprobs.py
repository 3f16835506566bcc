"""Per-token log-probabilities of the completion tokens without a [batch, tokens, vocab] logits tensor.

The straightforward way (`full_logits_logprobs`) asks the model for the logits of every completion
position at once: B x C x vocab in the model's dtype, then an fp32 copy for the log-softmax, and
autograd keeps them for backward. At Qwen2's vocabulary (151936) 8 sequences x 512 tokens are
3.7 GB of logits before backward doubles them.

`completion_logprobs_chunked` runs the decoder once, keeps only the last hidden states of the
completion-predicting positions, and computes the head (the lm_head matmul included) and the
log-softmax over `chunk_tokens` positions at a time (`ChunkedHead`): a chunk's logits are freed as
soon as its log-probabilities are out, and backward recomputes them one chunk at a time. The logits
alive at any moment are one chunk's, up to about 4 x chunk_tokens x vocab x 4 bytes while its backward
runs (its logits, their fp32 copy, the log-softmax's and the gather's gradients; measured: python -m
colo.bench --sections logprob_memory), whatever the batch. The cost is one more head matmul per chunk
in backward. The arithmetic is the straightforward way's, row for row (the head in the model's dtype,
then fp32): only float summation order differs. Where a master-weight optimizer gives the head weight
an fp32 main gradient (`main_grad`: colo.grpo's bf16 runs), the chunks' gradients are summed into it
in fp32; autograd would add them in the weight's dtype (at 8 x 4096 tokens, 128 bf16 additions),
which is what happens without one. On a GPU each chunk's product is itself fp32
(`torch.mm(..., out_dtype=torch.float32)`); torch has no such CPU kernel, so on a CPU a 16-bit head's
chunk products are rounded once each before the fp32 sum.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..moe_routing import replay_of
from .loss import token_logprobs

# Positions per chunk. A matmul of M rows reads the head's weight (vocab x hidden) once and does M
# multiply-adds per weight element: below ~300 rows a GPU's head matmul waits on memory, not on
# arithmetic (H100 bf16: ~990 TFLOP/s against 3.35 TB/s), so much smaller chunks would slow each step
# down; 256 rows is near that line while one fp32 chunk of logits stays small: 48 MiB at vocab 49152,
# 148 MiB at 151936 (the straightforward way: B x C / 256 times that, kept for backward). Not measured
# on a GPU.
CHUNK_TOKENS = 256


def trunk(model):
    """What computes the hidden states lm_head reads: a causal LM's decoder, or a vision-language model's
    base model (the vision tower and projector in front of its language model, which takes the images)."""
    from ..shared import is_vision_language

    if is_vision_language(model.config):
        return model.base_model
    decoder = model.get_decoder()
    # (Llama 4's text model names its checkpoint prefix `language_model` and its decoder `model`:
    # get_decoder() finds neither and returns the causal LM itself)
    if decoder is model and isinstance(getattr(model, "model", None), torch.nn.Module):
        return model.model
    return decoder


def own_positions(model, position_ids, model_inputs: dict | None):
    """The position ids the forward gets: None where the model places the tokens itself. Qwen2-VL's
    family (M-RoPE) computes 3-D rotary positions from the image grids and the processor's
    mm_token_type_ids (left padding read from the attention mask), as vLLM does; 1-D ids counted per
    token would flatten each image's grid and shift the text after it."""
    if model_inputs and "mm_token_type_ids" in model_inputs and hasattr(trunk(model), "get_rope_index"):
        return None
    return position_ids


def has_plain_head(model) -> bool:
    """Whether a causal LM's logits are exactly lm_head(trunk(...).last_hidden_state) (no soft-capping
    as Gemma 2's, no logit scale as Granite's): read off the model itself, by a two-token forward both
    ways the first time it is asked, the answer kept on the model. Others take the straightforward way."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "get_decoder") or \
            not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return False
    known = model.__dict__.get("_colo_plain_head")
    if known is None:
        head = model.get_output_embeddings()
        ids = torch.tensor([[1, 2]], device=head.weight.device)
        was_training = model.training
        model.eval()
        # The probe is no batch of the step: a MoE model's routing replay, forcing or measuring the step's
        # routes, must not apply to it (forcing(None): each router's own choice).
        replay = replay_of(model)
        try:
            with torch.no_grad(), replay.forcing(None) if replay is not None else contextlib.nullcontext():
                logits = model(input_ids=ids, use_cache=False).logits
                # (a trunk that returns no hidden states is no plain decoder)
                hidden = getattr(trunk(model)(input_ids=ids, use_cache=False), "last_hidden_state", None)
                known = hidden is not None and bool(torch.equal(logits, head(hidden)))
        finally:
            model.train(was_training)
        model.__dict__["_colo_plain_head"] = known
    return known


def full_logits_logprobs(model, input_ids, attention_mask, position_ids, completion_ids,
                         temperature: float = 1.0, model_inputs: dict | None = None,
                         entropies: list | None = None, router_logits: list | None = None) -> torch.Tensor:
    """The straightforward way: every completion position's logits at once, (B, C) log-probabilities.
    model_inputs: more keyword arguments of the forward (a vision-language model's image tensors).
    entropies: a list the (B, C) entropies of the distributions are appended to (no gradient).
    router_logits: a list a MoE model's router logits (one tensor per MoE layer) are appended to."""
    columns = completion_ids.shape[1]
    position_ids = own_positions(model, position_ids, model_inputs)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=columns + 1, use_cache=False, **_router_outputs(router_logits), **(model_inputs or {}))
    if router_logits is not None:
        router_logits.append(out.router_logits)
    # Logits at column t predict token t + 1: drop the prediction after the last token.
    if entropies is not None:
        entropies.append(token_entropies(out.logits[:, :-1, :].detach(), temperature))
    return token_logprobs(out.logits[:, :-1, :], completion_ids, temperature)


def _router_outputs(router_logits: list | None) -> dict:
    return {} if router_logits is None else {"output_router_logits": True}


@torch.no_grad()
def token_entropies(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy (nats) of softmax(logits / temperature) at each position, fp32, as TRL's
    entropy_from_logits over its temperature-scaled logits."""
    logits = logits.float() / temperature
    log_probs = logits.log_softmax(-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def completion_logprobs_chunked(model, input_ids, attention_mask, position_ids, completion_ids,
                                temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS,
                                model_inputs: dict | None = None, entropies: list | None = None,
                                router_logits: list | None = None) -> torch.Tensor:
    """log p(completion token | everything before it), (B, C) fp32, equal to full_logits_logprobs up to
    float summation order. model: a Hugging Face causal LM with has_plain_head (tied head or not)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    columns = completion_ids.shape[1]
    position_ids = own_positions(model, position_ids, model_inputs)
    out = trunk(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False, **_router_outputs(router_logits), **(model_inputs or {}))
    if router_logits is not None:
        router_logits.append(out.router_logits)
    # The C positions before each completion token predict it (the columns full_logits_logprobs keeps).
    return head_logprobs(model, out.last_hidden_state[:, -(columns + 1):-1], completion_ids, temperature,
                         chunk_tokens, entropies)


def head_logprobs(model, hidden, completion_ids, temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS,
                  entropies: list | None = None) -> torch.Tensor:
    """log p(completion token) from the (B, C, H) hidden states that predict the (B, C) completion tokens:
    the model's head and the log-softmax a chunk of positions at a time (ChunkedHead), (B, C) fp32."""
    rows, columns = completion_ids.shape
    head = model.get_output_embeddings()
    chunks = [] if entropies is not None else None
    out = ChunkedHead.apply(hidden.reshape(rows * columns, -1), head.weight, head.bias, completion_ids.reshape(-1),
                            temperature, chunk_tokens, chunks)
    if entropies is not None:
        entropies.append(torch.cat(chunks).view(rows, columns))
    return out.view(rows, columns)


class ChunkedHead(torch.autograd.Function):
    """log p(target) under softmax(head(hidden) / temperature), `chunk_tokens` rows at a time, for
    hidden (N, H), weight (V, H), bias (V) or None, targets (N); backward recomputes each chunk's
    logits and sums the weight's gradient over the chunks: in fp32 into the weight's main_grad where it
    has one, else in its dtype (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk_tokens: int, entropies=None):
        """entropies: a list each chunk's entropies are appended to (top_entropy_quantile), or None."""
        pieces = []
        with torch.no_grad():
            for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)):
                logits = F.linear(h, weight, bias)
                pieces.append(token_logprobs(logits, t, temperature))
                if entropies is not None:
                    entropies.append(token_entropies(logits, temperature))
            out = torch.cat(pieces)
        ctx.save_for_backward(hidden, targets)
        # The parameters themselves (not saved copies): their main_grad attribute is read in backward.
        ctx.weight, ctx.bias, ctx.temperature, ctx.chunk_tokens = weight, bias, temperature, chunk_tokens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, targets = ctx.saved_tensors
        weight, bias, size = ctx.weight, ctx.bias, ctx.chunk_tokens
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        main = getattr(weight, "main_grad", None) if want_weight else None
        # Where the optimizer keeps an fp32 main gradient the chunks are summed into it; elsewhere in
        # the weight's dtype, as autograd would (an fp32 buffer would add vocab x hidden x 4 bytes).
        weight_sum = main if main is not None else (torch.zeros_like(weight) if want_weight else None)
        bias_sum = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        for i, (h, t, g) in enumerate(zip(hidden.split(size), targets.split(size), grad_out.split(size))):
            grad_logits = _logprob_gradient(F.linear(h, weight, bias), t, g, ctx.temperature)
            if want_hidden:
                grad_hidden[i * size:i * size + len(h)] = grad_logits @ weight
            if want_weight:
                _add_product(weight_sum, grad_logits.t(), h)
            if want_bias:
                bias_sum += grad_logits.float().sum(0)
        grad_weight = weight_sum if want_weight and main is None else None
        grad_bias = bias_sum.to(bias.dtype) if want_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


@torch.no_grad()
def _logprob_gradient(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor, temperature: float):
    """The gradient of token_logprobs(logits, targets, temperature) times `grad`, w.r.t. logits, in their
    dtype: (onehot(target) - softmax(logits / T)) x grad / T, computed in fp32 as token_logprobs is.
    In closed form, so backward builds no autograd graph of its own."""
    scaled = grad.float() / temperature
    probs = (logits.float() / temperature).softmax(-1)
    probs.mul_(-scaled[:, None]).scatter_add_(1, targets[:, None], scaled[:, None])
    return probs.to(logits.dtype)


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b. An fp32 `out` of 16-bit a and b (a main gradient): the product computed in fp32 by the
    GEMM where torch can (CUDA), else in the inputs' dtype and added to `out` in fp32 without an fp32 copy
    of it first (a new vocab x hidden tensor a chunk). Of `out`'s own dtype: a running sum in that dtype,
    as autograd adds gradients."""
    global _MM_OUT_DTYPE
    if out.dtype != a.dtype and _MM_OUT_DTYPE and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            out += torch.mm(a, b, out_dtype=torch.float32)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm's out_dtype on this device
            _MM_OUT_DTYPE = False
    out += a @ b


_MM_OUT_DTYPE = True
