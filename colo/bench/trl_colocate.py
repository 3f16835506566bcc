"""Section trl: TRL's GRPOTrainer in colocate mode, stock and with colo (colo.trl.GRPOTrainer), on the
same tiny model, tokenizer, prompts and batch, and `colo.grpo`'s own scheduler on the same model and
batch, so colo's scheduler is compared with TRL's too.

- colo: `colo.trl.GRPOTrainer`: the engine built by colo (vLLM's default mode and kernels) in the
  dtype colo.trl picks for the device (bf16 with fp32 masters in TRL's optimizer where bf16 is
  fast, fp32 elsewhere), the trainer's parameters shared with it, `sync_weights` = publish()
  (0 bytes), the KV cache asleep while TRL trains.
- stock TRL: `trl.GRPOTrainer`, its own vLLM engine (default mode) and its per-parameter sync. Where
  vLLM packed the CPU linears, stock TRL crashes at its first sync (it is run, and the row quotes
  the error); the named variant then runs instead: stock TRL with vLLM's packed CPU kernels
  disabled (F.linear), so that a ratio always exists.
- colo.trl on the variant's kernels (where stock TRL cannot run): colo.trl with the same F.linear
  kernels as that baseline, so the row shows what colo itself adds or saves per step, apart from
  the kernel vLLM picks.
- colo.grpo: GRPOScheduler, dtype auto, the same prompts per step, completions per prompt and length.

Every run is a fresh Python process, as a user's script would be: TRL sets RANK/WORLD_SIZE and
torch.distributed state for its engine, and an earlier run's memory would shrink the KV cache stock
vLLM sizes from the free memory.

Both TRL sides run the same script (TRL's default dtypes: an fp32 model and bf16=True; learning rate,
seeds), each for warm-up steps plus measured steps, in alternating rounds so that load from other
processes hits both alike; the
row gives TRL's own `step_time` (median over measured steps of all rounds; TRL times its
training_step, which leaves out the optimizer step and logging), the sync time and bytes per sync,
memory (the KV cache bytes held while training and the process RSS), and where each side's whole
step goes (`PhaseClock`: `<side>_wall_s` from one step's start to the next, split into generate,
KV wake/sleep, sync, rewards, log-probability passes, loss, backward, optimizer and other; medians).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import tempfile
import time
from pathlib import Path

from colo.sizes import rss_bytes, tensor_bytes

from .baselines import UPDATABLE_VARIANT, stock_update_refused
from .measure import engine_unavailable_reason, in_fresh_process, ratio, rows_per_device
from .models import MAX_POSITIONS, save_random_model

SECTION = "trl"
REAL_MODEL = "SmolLM2-135M-Instruct"
# name -> Qwen2 config; vocabulary 512 to fit the byte-level BPE tokenizer built here.
SIZES = {
    "qwen2-trl-0.4M": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1),
    "qwen2-trl-12M": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                          num_key_value_heads=2),
    # Qwen2-0.5B's layers (its vocabulary is the tokenizer's here): 0.36B parameters.
    "qwen2-trl-0.36B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                            num_key_value_heads=2),
    # A real model (colo.smollm2: pretrained weights, its own tokenizer, EOS, vocabulary 49152); every
    # side, colo.grpo included, runs TRL's task on it (these prompts, the even-digits reward, EOS).
    REAL_MODEL: None,
}
QUICK_SIZES = ("qwen2-trl-0.4M",)
FULL_SIZES = ("qwen2-trl-0.4M", "qwen2-trl-12M", "qwen2-trl-0.36B", REAL_MODEL)
BATCH = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=16)
WARMUP = 2
QUICK_STEPS, FULL_STEPS = 2, 5  # measured steps after WARMUP


def build_model_dir(path: Path, config_kwargs: dict, arch: str = "qwen2") -> int:
    """A random bf16-ready model (a Qwen2 unless `arch` names another of colo.bench.models.ARCHITECTURES)
    and a byte-level BPE tokenizer trained on a word list; returns params."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [" ".join(f"w{i}" for i in range(j, j + 50)) for j in range(0, 500, 10)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    return save_random_model(path, dict(vocab_size=512, max_position_embeddings=MAX_POSITIONS, eos_token_id=1,
                                        pad_token_id=0, bos_token_id=None, **config_kwargs), arch=arch)


def real_model_params(model_dir: Path) -> int:
    import torch
    from transformers import AutoConfig

    from colo.kv_sizing import parameter_bytes

    return parameter_bytes(AutoConfig.from_pretrained(model_dir), torch.float32) // 4


def even_digits(completions, **kwargs):
    """The reward: the share of even digits in the completion's text."""
    return [sum(ch in "02468" for ch in c) / max(1, len(c)) for c in completions]


def prompts():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(f"w{3 + (7 * i + j) % 500}" for j in range(6)) for i in range(512)]})


def trl_args(out: Path, steps: int):
    import trl

    return trl.GRPOConfig(output_dir=str(out), use_vllm=True, vllm_mode="colocate", max_steps=steps, logging_steps=1,
                          report_to="none", learning_rate=1e-3, vllm_max_model_length=64, save_strategy="no",
                          use_cpu=True, seed=0, disable_tqdm=True, **BATCH)  # TRL's dtypes: fp32 model, bf16=True


def new_trainer(side: str, model_dir: Path, out: Path, steps: int, lora: dict | None = None):
    """`side`'s GRPOTrainer (colo.trl's for "colo...", TRL's otherwise; "...variant": on vLLM's plain CPU
    kernels) for the TRL script both sides run; its engine is built and compiled."""
    import trl

    from colo.trl import GRPOTrainer
    from colo.vllm_compat.forced_kernels import forced_cpu_gemm

    trainer_class = GRPOTrainer if side.startswith("colo") else trl.GRPOTrainer
    peft_kwargs = {}
    if lora is not None:
        from peft import LoraConfig

        peft_kwargs["peft_config"] = LoraConfig(**lora)
    with forced_cpu_gemm("plain") if side.endswith("variant") else contextlib.nullcontext():
        return trainer_class(model=str(model_dir), reward_funcs=even_digits, train_dataset=prompts(),
                             args=trl_args(out, steps), **peft_kwargs)


def compile_trl_engine(side: str) -> None:
    """Build `side`'s trainer on the quick run's model and release its engine: run ahead in a fresh
    process (COMPILE_AHEAD), so that a fresh machine's compile caches have the engine's code."""
    from colo.engine import release_llm

    with tempfile.TemporaryDirectory(prefix="colo-trl-ahead-") as tmp:
        model_dir = Path(tmp) / "model"
        build_model_dir(model_dir, SIZES[QUICK_SIZES[0]])
        release_llm(new_trainer(side, model_dir, Path(tmp) / "out", WARMUP + QUICK_STEPS).vllm_generation.llm)


# colo.bench.runner.fresh_process_plan: stock TRL's engine and colo.trl's (colo.grpo's and overlap's share
# its compiled code), each in its own process.
COMPILE_AHEAD = (functools.partial(compile_trl_engine, "stock"), functools.partial(compile_trl_engine, "colo"))


def run_trl(side: str, model_dir: Path, out: Path, steps: int, lora: dict | None = None) -> dict:
    """One TRL run of `steps` steps; step times (after warm-up), sync times and bytes, memory.
    lora: peft.LoraConfig's arguments, for a TRL script with `peft_config=LoraConfig(**lora)`."""
    from transformers.trainer_callback import PrinterCallback

    from colo.engine import kv_cache_region, release_llm
    from colo.vllm_compat import engine_dtype

    trainer = new_trainer(side, model_dir, out, steps, lora)

    trainer.remove_callback(PrinterCallback)  # it prints each log dict to stdout, which carries the bench's table
    generation = trainer.vllm_generation
    syncs = []
    sync = generation.sync_weights

    def timed_sync():
        start = time.perf_counter()
        sync()
        syncs.append(time.perf_counter() - start)

    generation.sync_weights = timed_sync  # instrumentation: the same wrapper on every side
    clock = PhaseClock(trainer, side.startswith("colo"))
    try:
        trainer.train()
        kv_train = kv_cache_region(generation.llm).stats()["resident_bytes"] if side.startswith("colo") else \
            _stock_kv_bytes(generation.llm)
        # TRL's sync pushes every (with PEFT: merged base) parameter.
        param_bytes = tensor_bytes(p for n, p in trainer.model.named_parameters() if "lora_" not in n)
        result = {
            "step_s": [h["step_time"] for h in trainer.state.log_history if "step_time" in h][WARMUP:],
            "sync_s": syncs[WARMUP:], "kv_cache_bytes_during_train": kv_train, "rss_bytes": rss_bytes(),
            # colo: what its syncs reported copying (publish, and any re-share); TRL: every parameter.
            "sync_bytes": max(r["bytes_copied"] + r["reshared_bytes"] for r in generation.colo_sync_reports[WARMUP:])
            if side.startswith("colo") else param_bytes,
            "reward": [h["reward"] for h in trainer.state.log_history if "reward" in h],
            "engine_dtype": str(engine_dtype(generation.llm)).removeprefix("torch."),
            "trainer_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
            "engine_dtype_why": getattr(trainer, "colo_engine_dtype_reason", "vLLM's default for the checkpoint"),
            "phases": clock.steps[WARMUP:],
            "weight_bytes": weight_bytes(trainer.model, generation.llm),
        }
    finally:
        release_llm(generation.llm)
        del trainer, generation
        gc.collect()
    return result


PHASES = ("generate", "kv_wake_sleep", "sync", "rewards", "logprob_passes", "loss", "backward", "optimizer")


def model_passes(trainer) -> str:
    """The name of the trainer's method that runs its models on a batch (student and reference, or
    teacher): GRPO's and RLOO's log-probability passes, the distillation's backbone passes."""
    return ("_get_per_token_logps_and_entropies" if hasattr(trainer, "_get_per_token_logps_and_entropies")
            else "_get_last_hidden_state")


class PhaseClock:
    """Where each TRL step's wall time goes, on both sides alike: wrappers on the trainer's own
    methods (and, for colo.trl, its KV cache wake and sleep) add their exclusive time (nested
    wrapped calls are not counted twice) to the step's phase; a step runs from one on_step_begin to
    the next, so data loading and logging are in it too ("other": what no phase claims)."""

    def __init__(self, trainer, colo_side: bool):
        from transformers import TrainerCallback

        self.steps: list[dict] = []
        self._current: dict | None = None
        self._began = None
        self._stack: list[list] = []   # [phase, start, time spent in nested phases]
        generation = trainer.vllm_generation
        for owner, attr, phase in ((generation, "generate", "generate"), (generation, "sync_weights", "sync"),
                                   (trainer, "_calculate_rewards", "rewards"),
                                   (trainer, model_passes(trainer), "logprob_passes"),
                                   (trainer, "compute_loss", "loss"), (trainer.accelerator, "backward", "backward")):
            if hasattr(owner, attr):  # (TRL's distillation scores no rewards)
                self._wrap(owner, attr, phase)
        if colo_side:
            import colo.engine

            self._wrap(colo.engine, "wake_kv_cache", "kv_wake_sleep")  # colo.trl imports it at each call
            self._wrap(generation, "sleep_kv_cache", "kv_wake_sleep")
        clock = self

        class Steps(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock._next_step()

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                clock._enter("optimizer")

            def on_optimizer_step(self, args, state, control, **kwargs):
                clock._leave()

            def on_train_end(self, args, state, control, **kwargs):
                clock._next_step(last=True)

        trainer.add_callback(Steps())

    def _wrap(self, owner, attr, phase) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            self._enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self._leave()

        setattr(owner, attr, timed)

    def _enter(self, phase: str) -> None:
        self._stack.append([phase, time.perf_counter(), 0.0])

    def _leave(self) -> None:
        phase, start, nested = self._stack.pop()
        spent = time.perf_counter() - start
        if self._stack:
            self._stack[-1][2] += spent
        if self._current is not None:
            self._current[phase] = self._current.get(phase, 0.0) + spent - nested

    def _next_step(self, last: bool = False) -> None:
        now = time.perf_counter()
        if self._current is not None:
            self._current["wall"] = now - self._began
            self._current["other"] = self._current["wall"] - sum(self._current.get(p, 0.0) for p in PHASES)
            self.steps.append(self._current)
        self._current, self._began = (None, None) if last else ({}, now)


def phase_medians(steps: list[dict]) -> dict:
    """Median seconds per phase (and wall, other) over the measured steps."""
    return {f"{phase}_s": statistics.median(s.get(phase, 0.0) for s in steps)
            for phase in ("wall", *PHASES, "other")} if steps else {}


def measured_sides(model_dir: Path, tmp: Path, steps: int, rounds: int, progress, name: str,
                   lora: dict | None = None, colo_variant: bool = False) -> tuple[dict, str]:
    """{side: its run_trl results} over `rounds` alternating rounds of fresh processes, and what stock TRL
    raised ('' where it trains). Stock TRL's first measured run is also the probe of whether it runs
    here: where it raises, the baseline is the variant ("variant"), and with colo_variant colo.trl runs
    on the variant's kernels too ("colo-variant")."""
    try:
        stock_first, refused = in_fresh_process(run_trl, "stock", model_dir, tmp / "stock0", steps, lora), ""
    except Exception as e:  # noqa: BLE001 - the error is the finding
        stock_first, refused = None, f"{type(e).__name__}: {e}"
    baseline = "variant" if refused else "stock"
    others = ["colo", *(["colo-variant"] if refused and colo_variant else [])]
    sides = {side: [] for side in (*others, baseline)}
    for i in progress(range(rounds), name):
        for side in ([baseline, *others] if i % 2 == 0 else [*others, baseline]):
            if i == 0 and side == "stock":
                sides[side].append(stock_first)   # its probe run, the first of this round
                continue
            sides[side].append(in_fresh_process(run_trl, side, model_dir, tmp / f"{side}{i}", steps, lora))
    return sides, refused


def grpo_and_kernels(model_dir: Path, steps: int, lora: dict | None = None, trl_task: bool = False) -> tuple:
    """run_colo_grpo's result and the CPU kernels vLLM picks here (kernels_of), in one process."""
    return run_colo_grpo(model_dir, steps, lora, trl_task), kernels_of(model_dir)


def weight_bytes(model, llm) -> int:
    """Bytes of the trainer's and the engine's parameters together, each storage once (one copy when
    they are shared). vLLM's packed CPU kernel copies are not parameters and are not counted."""
    from colo.vllm_compat import engine_model

    storages = {}
    for p in [*model.parameters(), *engine_model(llm).parameters()]:
        if p.numel():
            storage = p.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_colo_grpo(model_dir: Path, steps: int, lora: dict | None = None, trl_task: bool = False) -> dict:
    """colo.grpo's own step on the same model and batch: on the toy task (fixed-length completions), or
    with trl_task on TRL's (the same prompts and reward, generation stopping at EOS)."""
    import json

    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask

    config = GRPOConfig(prompts_per_step=BATCH["per_device_train_batch_size"] // BATCH["num_generations"],
                        num_generations=BATCH["num_generations"], max_new_tokens=BATCH["max_completion_length"],
                        learning_rate=1e-3, save_every=0, ignore_eos=not trl_task,  # dtype auto, as TRL's side
                        **({} if lora is None else {"lora_rank": lora["r"], "lora_alpha": lora["lora_alpha"],
                                                    "lora_targets": tuple(lora["target_modules"])}))
    if trl_task:
        run = GRPOScheduler(model_dir, config=config, dataset=prompts(), reward_funcs=[even_digits])
    else:
        task = ToyTask(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        run = GRPOScheduler(model_dir, task.rewards, task.prompts, config)
    try:
        records = [run.train_step() for _ in range(WARMUP + steps)][WARMUP:]
    finally:
        run.close()
        del run
        gc.collect()
    return {"step_s": [r["step_s"] for r in records], "sync_s": [r["publish_s"] for r in records],
            "dtype": config.resolve_dtype("cpu").dtype, "records": records}


def measure_size(name: str, quick: bool, progress, device: str = "cpu", rounds: int = 2,
                 same_kernels: bool | None = None) -> list[dict]:
    """The rows of one model size; `rounds` alternating rounds of every TRL side (one fresh process each).
    same_kernels: where stock TRL cannot run, also colo.trl on the baseline's kernels (default: full run)."""
    steps = QUICK_STEPS if quick else FULL_STEPS
    with tempfile.TemporaryDirectory(prefix="colo-trl-") as tmp:
        tmp = Path(tmp)
        real = SIZES[name] is None
        if real:
            from colo.smollm2 import smollm2_dir

            (tmp / "model").symlink_to(smollm2_dir(), target_is_directory=True)
            params = real_model_params(tmp / "model")
        else:
            params = build_model_dir(tmp / "model", SIZES[name])
        same_kernels = not quick if same_kernels is None else same_kernels
        sides, refused = measured_sides(tmp / "model", tmp, WARMUP + steps, rounds, progress, name,
                                        colo_variant=same_kernels)
        baseline = "variant" if refused else "stock"
        grpo, kernels = in_fresh_process(grpo_and_kernels, tmp / "model", steps, None, real)
    merged = {side: {key: [v for run in runs for v in run[key]] for key in ("step_s", "sync_s", "phases")}
              for side, runs in sides.items()}
    breakdown = {side: phase_medians(values["phases"]) for side, values in merged.items()}
    colo, base = merged["colo"], merged[baseline]
    base_name = f"stock TRL on {UPDATABLE_VARIANT}" if refused else "stock TRL (vLLM default mode)"
    dtypes = {f"{key}_{what}": sides[side][0][what] for key, side in (("colo", "colo"), ("baseline", baseline))
              for what in ("engine_dtype", "trainer_dtype")}
    common = {"section": SECTION, "device": device, "model": name, "params": params, **dtypes,
              "colo_engine_dtype_why": sides["colo"][0]["engine_dtype_why"],
              "cpu_kernels": kernels, **{f"batch_{k}": v for k, v in BATCH.items()},
              "steps_measured": len(colo["step_s"])}
    note = (f"TRL 1.16 GRPOTrainer, colocate mode, same script on both sides; medians of TRL's step_time over "
            f"{steps} steps after {WARMUP} warm-up steps, {rounds} alternating round(s)")
    if refused:
        note += f"; stock TRL cannot run here: {stock_update_refused(kernels)}; it raised {refused[:300]}"
    colo_step, base_step = statistics.median(colo["step_s"]), statistics.median(base["step_s"])
    rows = [{**common, "case": f"TRL step {name}: colo.trl", "colo_s": colo_step, "baseline": base_name,
             "baseline_s": base_step, "ratio": ratio(base_step, colo_step),
             "colo_sync_s": statistics.median(colo["sync_s"]), "baseline_sync_s": statistics.median(base["sync_s"]),
             "colo_sync_bytes": sides["colo"][0]["sync_bytes"], "baseline_sync_bytes": sides[baseline][0]["sync_bytes"],
             "colo_kv_cache_bytes_during_train": sides["colo"][0]["kv_cache_bytes_during_train"],
             "baseline_kv_cache_bytes_during_train": sides[baseline][0]["kv_cache_bytes_during_train"],
             "colo_rss_bytes": max(r["rss_bytes"] for r in sides["colo"]),
             "baseline_rss_bytes": max(r["rss_bytes"] for r in sides[baseline]),
             "goal": "no longer per step than stock TRL", "goal_met": colo_step <= base_step, "note": note,
             **{f"colo_{k}": v for k, v in breakdown["colo"].items()},
             **{f"baseline_{k}": v for k, v in breakdown[baseline].items()}}]
    if "colo-variant" in merged:
        same = merged["colo-variant"]
        same_step = statistics.median(same["step_s"])
        rows.append({**common, "case": f"TRL step {name}: colo.trl, same kernels as the baseline", "colo_s": same_step,
                     "baseline": base_name, "baseline_s": base_step, "ratio": ratio(base_step, same_step),
                     "colo_sync_s": statistics.median(same["sync_s"]),
                     "colo_sync_bytes": sides["colo-variant"][0]["sync_bytes"],
                     **{f"colo_{k}": v for k, v in breakdown["colo-variant"].items()},
                     "note": f"colo.trl on {UPDATABLE_VARIANT} too: what colo itself adds or saves per step, apart "
                             "from the kernel vLLM picks"})
    grpo_step = statistics.median(grpo["step_s"])
    rows.append({**common, "case": f"TRL step {name}: colo.grpo scheduler", "colo_s": grpo_step,
                 "baseline": base_name, "baseline_s": base_step, "ratio": ratio(base_step, grpo_step),
                 "colo_sync_s": statistics.median(grpo["sync_s"]), "goal": "<= 0.8x TRL's step",
                 "goal_met": grpo_step <= 0.8 * base_step,
                 "colo_engine_dtype": grpo["dtype"], "colo_trainer_dtype": grpo["dtype"] + " (fp32 masters)"
                 if grpo["dtype"] == "bf16" else grpo["dtype"],
                 "note": f"colo.grpo's GRPOScheduler (dtype auto, {'TRL' if real else 'toy'} task) with TRL's "
                         "batch: prompts per step = per_device_train_batch_size / num_generations, same completion "
                         "length; TRL's step includes its own reward, logging and dataloader work"})
    return rows


def kernels_of(model_dir: Path, dtype: str = "bfloat16") -> dict:
    """The CPU kernels vLLM picks for this model in `dtype` here (a short-lived colo engine)."""
    import colo
    from colo.engine import build_llm, cpu_kernels, release_llm

    llm = build_llm(model_dir, colo.Pool("cpu"), dtype=dtype, kv_cache_bytes=32 << 20, max_model_len=64,
                    enforce_eager=True)
    try:
        return cpu_kernels(llm)
    finally:
        release_llm(llm)
        del llm
        gc.collect()


def _stock_kv_bytes(llm) -> int:
    """A stock engine's KV cache is never released: its size is what it holds while TRL trains."""
    from colo.vllm_compat import engine_kv_caches

    seen, total = set(), 0
    for cache in engine_kv_caches(llm):
        storage = cache.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _trl_missing_reason() -> str:
    try:
        import colo.trl  # noqa: F401 - checks the TRL release too
    except ImportError as e:
        return str(e)
    return ""


def _unavailable_reason(device: str) -> str:
    why = engine_unavailable_reason(device) or _trl_missing_reason()
    if not why and device == "cuda":
        why = "colo.trl's GPU case has not been written as a benchmark yet (TRL on CPU here)"
    return why


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    def measure(device: str) -> list[dict]:
        return [row for name in (QUICK_SIZES if quick else FULL_SIZES)
                for row in measure_size(name, quick, progress, device, rounds=1 if quick else 2)]

    return rows_per_device(SECTION, "TRL step", devices, _unavailable_reason, measure)
