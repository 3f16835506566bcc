"""Section logprob_memory: peak memory of the train phase's log-probabilities + GRPO loss, forward and
backward, computed a chunk of tokens at a time (colo.grpo.logprobs, what colo.grpo trains with)
against the straightforward way (every completion position's logits at once, as TRL does), and, in
the full run, against chunking the log-softmax only (`head_outside_*`: the lm_head matmul outside the
chunks, so all logits exist at once in the model's dtype and are kept for backward).

A Llama-shaped model with few layers (hidden 256, 2 layers, tied embeddings: the decoder is small on
purpose, so the figures are mostly the logits) at the vocabulary sizes of SmolLM2 (49152) and Qwen2
(151936; quick: SmolLM2's only), in the dtype colo.grpo's `auto` picks on the machine, one rollout
micro-batch: 8 sequences x 512 completion tokens after 64 prompt tokens (quick: 4 x 256). One forward
+ GRPO loss + backward per variant, each in a fresh process (measure.in_fresh_process), after a
warm-up pass on one short sequence (so lazily built kernels and the parameters' .grad are already there
and count for neither side).

On a CPU the figure is the peak resident set increase: the kernel's high-water mark (VmHWM), reset
through /proc/self/clear_refs just before the forward, minus VmRSS at that moment, after gc and
malloc_trim. Tensors of more than 32 MiB (glibc's largest mmap threshold) are mmapped and return to
the OS when freed; smaller ones may stay in glibc's heap and be counted again when reused elsewhere,
so the increase may exceed what torch held at once (pages allocated but never written count for
nothing). On a GPU it is torch.cuda.max_memory_allocated over memory_allocated before the
forward. Each row also gives the bytes autograd saved for backward during the forward (each storage
once, parameters not counted), and both sides' seconds (colo_s: chunked, with its recomputation;
noisy on a shared machine).

The full run adds a row for gradient checkpointing (colo.grpo --gradient-checkpointing): one 2048-token
completion through an 8-layer model of that width, with transformers' checkpointing against without:
the activations autograd keeps, the peak, and the recomputation's time.
"""
from __future__ import annotations

import json
import sys

from .measure import in_fresh_process, ratio, rows_per_device

SECTION = "logprob_memory"
VOCABS = (49152, 151936)
QUICK_VOCABS = VOCABS[:1]  # the quick bench keeps to its minutes: each vocabulary is two fresh processes
MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)
PROMPT_TOKENS = 64
FULL_BATCH, QUICK_BATCH = (8, 512), (4, 256)  # sequences, completion tokens
# The gradient-checkpointing row (colo.grpo --gradient-checkpointing): one 2k-token completion through a
# deeper model of the same width, where the decoder's activations, not the logits, dominate.
CHECKPOINTING_LAYERS, CHECKPOINTING_TOKENS = 8, 2048
VARIANTS = ("chunked", "straightforward")
FULL_VARIANTS = VARIANTS + ("head_outside",)


def unavailable_reason(device: str) -> str:
    import torch

    return "" if device == "cpu" or torch.cuda.is_available() else "no CUDA device visible to torch here"


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    sequences, tokens = QUICK_BATCH if quick else FULL_BATCH
    variants = VARIANTS if quick else FULL_VARIANTS

    def measure(device: str) -> list[dict]:
        rows = [measure_vocab(vocab, sequences, tokens, device, variants)
                for vocab in progress(QUICK_VOCABS if quick else VOCABS, f"{device} vocab")]
        if not quick:  # (the quick bench keeps to its minutes)
            rows.append(measure_checkpointing(CHECKPOINTING_LAYERS, CHECKPOINTING_TOKENS, device))
        return rows

    return rows_per_device(SECTION, "peak memory of log-probabilities", devices, unavailable_reason, measure)


def measure_vocab(vocab: int, sequences: int, tokens: int, device: str = "cpu", variants=VARIANTS) -> dict:
    from colo.grpo.logprobs import CHUNK_TOKENS

    chunked, full, *others = (child(vocab, sequences, tokens, variant, device) for variant in variants)
    elt = chunked["dtype_bytes"]
    row = {
        "section": SECTION, "case": f"vocab {vocab}: {sequences} x {tokens} tokens, {chunked['dtype']}",
        "device": device, "colo_s": chunked["seconds"], "baseline": "straightforward (all logits at once)",
        "baseline_s": full["seconds"], "time_ratio": ratio(full["seconds"], chunked["seconds"]),
        **peak_figures(chunked["peak_bytes"], full["peak_bytes"]),
        "saved_for_backward_bytes": chunked["saved_bytes"], "baseline_saved_for_backward_bytes": full["saved_bytes"],
        "chunk_tokens": CHUNK_TOKENS, "chunk_logits_bytes": CHUNK_TOKENS * vocab * 4,
        # model-dtype logits, and their fp32 copy unless the model is fp32 (then .float() is a no-op)
        "full_logits_bytes": sequences * tokens * vocab * (elt + (4 if elt != 4 else 0)), "params": chunked["params"],
        "logprob_sum_abs_diff": abs(chunked["logprob_sum"] - full["logprob_sum"]),  # the same values: ~0
    }
    note = (f"peak = {chunked['peak_what']} during one forward + GRPO loss + backward, each side in a fresh "
            "process; chunk_logits_bytes: one chunk's fp32 logits; full_logits_bytes: the straightforward way's "
            "logits (model dtype, and their fp32 copy if that differs); ratio = memory_ratio = baseline_peak_bytes / "
            "peak_bytes; time_ratio = baseline_s / colo_s")
    if others:
        outside = others[0]
        row.update(head_outside_peak_bytes=outside["peak_bytes"], head_outside_s=outside["seconds"],
                   head_outside_saved_for_backward_bytes=outside["saved_bytes"])
        note += "; head_outside_*: the lm_head matmul outside the chunks (all logits at once in the model dtype)"
    return {**row, "note": note}


def measure_checkpointing(layers: int, tokens: int, device: str = "cpu", vocab: int = VOCABS[0]) -> dict:
    """One completion of `tokens` tokens through a `layers`-layer model, with transformers' gradient
    checkpointing (as colo.grpo --gradient-checkpointing on enables it) against without: the bytes autograd
    keeps for backward (exact), the peak, and the time the recomputation costs."""
    plain, checkpointed = (child(vocab, 1, tokens, variant, device, layers) for variant in ("chunked", "checkpointed"))
    return {
        "section": SECTION, "case": f"gradient checkpointing: {layers} layers, 1 x {tokens} tokens, {plain['dtype']}",
        "device": device, "colo_s": checkpointed["seconds"], "baseline": "without gradient checkpointing",
        "baseline_s": plain["seconds"], "time_ratio": ratio(plain["seconds"], checkpointed["seconds"]),
        "saved_for_backward_bytes": checkpointed["saved_bytes"],
        "baseline_saved_for_backward_bytes": plain["saved_bytes"],
        **peak_figures(checkpointed["peak_bytes"], plain["peak_bytes"]), "params": plain["params"],
        "logprob_sum_abs_diff": abs(plain["logprob_sum"] - checkpointed["logprob_sum"]),
        "note": ("colo = with gradient checkpointing (chunked log-probabilities either way); saved_for_backward_bytes: "
                 "the activations autograd keeps; ratio = memory_ratio = baseline_peak_bytes / peak_bytes; "
                 "time_ratio = baseline_s / colo_s (< 1: the recomputation's cost)"),
    }


def peak_figures(peak_bytes: int, baseline_peak_bytes: int) -> dict:
    """A row's peaks, and the figures the closing table shows for them: the section is about memory, so
    its ratio is the peaks' (the times keep theirs as time_ratio)."""
    memory_ratio = baseline_peak_bytes / max(peak_bytes, 1)
    return {"peak_bytes": peak_bytes, "baseline_peak_bytes": baseline_peak_bytes, "memory_ratio": memory_ratio,
            "colo_figure": peak_bytes / 2**20, "baseline_figure": baseline_peak_bytes / 2**20,
            "figure_unit": "MiB", "ratio": memory_ratio}


def child(vocab: int, sequences: int, tokens: int, variant: str, device: str, layers: int | None = None) -> dict:
    try:
        return in_fresh_process(measure_child, vocab, sequences, tokens, variant, device, layers)
    except Exception as e:  # noqa: BLE001 - said with the variant it measured
        raise RuntimeError(f"{variant}, vocab {vocab}: {type(e).__name__}: {e}") from e


# ---- in the fresh process -------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settle_and_mark_cpu() -> int:
    """RSS now, after returning what can be returned, with the high-water mark reset to it."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return _status_kib("VmRSS") * 1024


def measure_child(vocab: int, sequences: int, tokens: int, variant: str, device: str, layers: int | None = None) -> dict:
    import time

    import torch

    from colo.dtype_choice import fastest_dtype
    from colo.grpo.batch import pack
    from colo.grpo.logprobs import completion_logprobs_chunked, full_logits_logprobs
    from colo.grpo.loss import grpo_loss

    from .models import random_model

    dtype = fastest_dtype(device).dtype
    shape = {**MODEL, "vocab_size": vocab, **({"num_hidden_layers": layers} if layers else {}),
             **({"max_position_embeddings": PROMPT_TOKENS + tokens + 16} if tokens > 900 else {})}
    model = random_model(shape, arch="llama", dtype=dtype).to(device).train()
    if variant == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fn = {"chunked": completion_logprobs_chunked, "checkpointed": completion_logprobs_chunked,
          "straightforward": full_logits_logprobs, "head_outside": head_outside_chunks}[variant]
    g = torch.Generator().manual_seed(0)

    def batch(rows, prompt, completion):
        ids = torch.randint(1, vocab, (rows, prompt + completion), generator=g).tolist()
        return pack([r[:prompt] for r in ids], [r[prompt:] for r in ids]).to(device)

    def step(b):
        logprobs = fn(model, b.input_ids, b.attention_mask, b.position_ids, b.completion_ids)
        advantages = torch.linspace(-1, 1, len(b), device=device)
        grpo_loss(logprobs, logprobs.detach(), advantages, b.completion_mask).loss.backward()
        return logprobs.detach()

    step(batch(1, 8, 8))  # warm-up: kernels, thread pools, the parameters' .grad
    model.zero_grad(set_to_none=False)
    b = batch(sequences, PROMPT_TOKENS, tokens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack_hook(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _settle_and_mark_cpu()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        logprobs = step(b)
    if device == "cuda":
        torch.cuda.synchronize()
        peak, what = torch.cuda.max_memory_allocated() - before, "torch.cuda.max_memory_allocated increase"
    else:
        peak, what = _status_kib("VmHWM") * 1024 - before, "peak RSS increase (VmHWM - VmRSS before)"
    seconds = time.perf_counter() - start
    return {"peak_bytes": peak, "peak_what": what, "seconds": seconds, "saved_bytes": sum(saved.values()),
            "dtype": str(dtype).removeprefix("torch."), "dtype_bytes": dtype.itemsize,
            "params": sum(p.numel() for p in model.parameters()),
            "logprob_sum": float(logprobs.double().sum())}


def head_outside_chunks(model, input_ids, attention_mask, position_ids, completion_ids, temperature=1.0):
    """Chunking without the head: all logits at once (model dtype), the log-softmax chunked and
    checkpointed; each chunk keeps its slice, so the whole logits tensor lives until backward ends."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from colo.grpo.logprobs import CHUNK_TOKENS
    from colo.grpo.loss import token_logprobs

    rows, columns = completion_ids.shape
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=columns + 1, use_cache=False).logits[:, :-1].reshape(rows * columns, -1)
    pieces = [checkpoint(token_logprobs, z, t, temperature, use_reentrant=False)
              for z, t in zip(logits.split(CHUNK_TOKENS), completion_ids.reshape(-1).split(CHUNK_TOKENS))]
    return torch.cat(pieces).view(rows, columns)


if __name__ == "__main__":
    print(json.dumps(measure_child(**json.loads(sys.argv[1]))))
