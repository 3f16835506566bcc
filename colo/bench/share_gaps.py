"""What colo.share_check measures on the machine at hand: the engine's gap to the fp32 computation of the
shared weights beside the trainer's own rounding, for real models and every tiny family, at share time
and after a publish of changed weights; and what it measures of a different function (a config field or
a module changed on the trainer's side only, a permuted weight) and of a kernel copy left stale.

    python -m colo.bench.share_gaps --json bench/results/share-gaps-KIND.json          # everything
    python -m colo.bench.share_gaps --models smollm2 gemma3-270m --dtypes bfloat16 --compiled

Each row: engine (mean |engine - fp32|), rounding (mean |trainer in the 16-bit dtype - fp32|), their
ratio (the check refuses beyond colo.share_check.ROUNDING_FACTOR), and whether the check refused.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

REAL_MODELS = ("smollm2", "gemma3-270m")
# As tests/sharing/test_families.py builds them: the families whose checkpoints tie the LM head to the
# embedding, and a family's own fields.
TIED = ("gemma2", "gemma3", "gemma4", "gemma4_moe", "smollm3", "cohere", "bloom")
FAMILY_FIELDS = {"deepseek_v3": dict(num_key_value_heads=2)}


def _model_dir(name: str, workdir: Path) -> Path:
    if name == "smollm2":
        from colo.smollm2 import smollm2_dir

        return smollm2_dir()
    if name == "gemma3-270m":
        from colo.gemma3 import gemma3_dir

        return gemma3_dir()
    from colo.bench.models import random_model

    path = workdir / name
    if not (path / "config.json").exists():   # the tests' tiny shape (tests/conftest.py's TINY_CONFIG)
        config = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=name in TIED)
        random_model({**config, **FAMILY_FIELDS.get(name, {})}, arch=name).save_pretrained(path)
    return path


def _row(model: str, dtype: str, case: str, gap, refused: bool) -> dict:
    ratio = gap.engine / gap.rounding if gap.rounding > 0 else None
    return dict(model=model, dtype=dtype, case=case, engine=gap.engine, rounding=gap.rounding, direct=gap.direct,
                ratio=ratio, tokens=gap.tokens, refused=refused)


@contextlib.contextmanager
def stale_kernel_copies(llm):
    """Inside the block every CPU linear of the engine computes from a copy of its weight made on entry,
    which no publish refreshes: what a kernel keeping a private copy colo does not know of would do (on
    every CPU kind and GEMM path: the kernels' own closures are set aside)."""
    import torch.nn.functional as F

    from colo import vllm_compat as compat

    modules = compat.cpu_linear_modules(compat.engine_model(llm))
    kept = [(module, module.cpu_linear) for module in modules]
    for module in modules:
        frozen = module.weight.detach().clone()
        module.cpu_linear = lambda x, weight, bias, _frozen=frozen: F.linear(
            x, _frozen, None if bias is None else bias.to(x.dtype))
    try:
        yield len(modules)
    finally:
        for module, linear in kept:
            module.cpu_linear = linear


def changed_function(model, change: str):
    """A copy of the trainer's model computing another function of the same weights (one of CHANGES)."""
    from colo.shared import materialize_buffers
    from colo.vllm_compat import building_trainer_models

    config = copy.deepcopy(model.config)
    text = config.get_text_config()
    if change.startswith("rope_theta"):   # (Gemma 3 keeps one rope per layer type)
        rope = text.rope_parameters
        text.rope_parameters = {**rope, "rope_theta": rope["rope_theta"] * 0.1} if "rope_theta" in rope else \
            {kind: {**value, "rope_theta": value["rope_theta"] * 0.1} for kind, value in rope.items()}
    elif change.startswith("rms_norm_eps"):
        text.rms_norm_eps = 1e-2
    with building_trainer_models(), torch.device("meta"):
        other = type(model)._from_config(config, dtype=model.dtype)
    other.load_state_dict(model.state_dict(), assign=True)   # the trainer's own tensors, not copies
    materialize_buffers(other, next(model.parameters()).device)   # (the rotary tables of the new config)
    if change.startswith("embedding"):
        embedding = other.get_input_embeddings()
        forward = embedding.forward
        embedding.forward = lambda ids: forward(ids) * 1.5
    elif change.startswith("permuted"):
        weight = other.model.layers[len(other.model.layers) // 2].mlp.down_proj.weight
        weight.data = weight.data[:, torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(0))]
        # (a copy: the trainer's weight is as it was)
    return other.train()


CHANGES = ("rope_theta x0.1", "rms_norm_eps 1e-2", "embedding x1.5", "permuted down_proj")


def measure(model: str, dtype: str, workdir: Path, compiled: bool, wrong: bool) -> list[dict]:
    import colo
    from colo.engine import build_llm, release_llm
    from colo.share_check import EngineMismatch, check_engine_follows, check_shared_logprobs, probe_sequences

    real = model in REAL_MODELS
    llm = build_llm(_model_dir(model, workdir), dtype=dtype, enforce_eager=not compiled,
                    max_model_len=512 if real else 256, kv_cache_bytes=64 << 20, skip_tokenizer_init=not real)
    rows = []
    try:
        try:
            shared = colo.shared_model(llm)
        except EngineMismatch as e:
            return [_row(model, dtype, "at share" if not e.after_publish else "after publish", e.gap, True)]
        checks = shared.logprob_checks
        rows += [_row(model, dtype, "at share", checks["at_share"], False),
                 _row(model, dtype, "after publish", checks["after_publish"], False)]
        if not wrong:
            return rows
        probe = probe_sequences(shared.hf_model, llm)
        for change in CHANGES:
            try:
                other = changed_function(shared.hf_model, change)
            except (AttributeError, KeyError, TypeError) as e:   # a family without the field or module
                print(f"  {model} {dtype}: {change} not applicable ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            try:
                rows.append(_row(model, dtype, change, check_shared_logprobs(other, llm, probe), False))
            except EngineMismatch as e:
                rows.append(_row(model, dtype, change, e.gap, True))
        if compiled:   # (a compiled engine's kernels cannot be swapped: compiled code holds them)
            return rows
        with stale_kernel_copies(llm):
            try:
                rows.append(_row(model, dtype, "stale kernel copies",
                                 check_engine_follows(shared, shared.hf_model, llm, probe), False))
            except EngineMismatch as e:
                rows.append(_row(model, dtype, "stale kernel copies", e.gap, True))
    finally:
        release_llm(llm)
    return rows


def main(argv=None) -> int:
    from colo.bench.machine import machine_info
    from colo.bench.models import ARCHITECTURES
    from colo.bench.runner import source_commit
    from colo.engine import quiet_vllm_logs

    parser = argparse.ArgumentParser(prog="python -m colo.bench.share_gaps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[*REAL_MODELS, *ARCHITECTURES])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--compiled", action="store_true", help="compiled engines (default: eager)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/colo-share-gaps"))
    args = parser.parse_args(argv)
    quiet_vllm_logs()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = dict(command=" ".join(["python -m colo.bench.share_gaps", *(argv or sys.argv[1:])]),
                  commit=source_commit(), machine=machine_info(), rows=[])
    for model in args.models:
        for dtype in args.dtypes:
            if model == "qwen3_next" and dtype == "float32":
                continue   # vLLM's CPU linear attention is bf16 only
            started = time.perf_counter()
            try:
                rows = measure(model, dtype, args.workdir, args.compiled, wrong=model in REAL_MODELS)
            except Exception as e:  # noqa: BLE001 - one family's failure is a row, not the end of the table
                rows = [dict(model=model, dtype=dtype, case="error", error=f"{type(e).__name__}: {e}")]
            for row in rows:
                row["compiled"] = args.compiled
                result["rows"].append(row)
                if "error" in row:
                    print(f"{model:18s} {dtype:9s} error: {row['error'][:150]}", flush=True)
                else:
                    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
                    print(f"{model:18s} {dtype:9s} {row['case']:22s} engine {row['engine']:.3g} rounding "
                          f"{row['rounding']:.3g} ratio {ratio} direct {row['direct']:.3g}"
                          f"{' REFUSED' if row['refused'] else ''}", flush=True)
            print(f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
