"""Section agentic: an agentic GRPO step (tools, an environment, two turns) with colo against stock TRL
1.16, on the same model, task, tools, environment and batch.

The task: SmolLM2-135M-Instruct with TRL's Qwen2.5 template (tool-capable, ChatML like SmolLM2's own)
on sums of two 4-5 digit numbers (colo.grpo.arithmetic's, with the system message that shows the
call), the `add` tool and the `Tally` environment below, each call taking TOOL_LATENCY_S as a code
runner or a search would; guided decoding makes every turn one well-formed call, so every side runs
the same number of calls: one per rollout, in one round of tools (max_tool_calling_iterations=1).

- stock TRL: `trl.GRPOTrainer` with `tools=` and `environment_factory=`: its own tool loop, one engine
  call per turn, the tools run one after another on the trainer's thread between the turns (the
  engine idle meanwhile). Where stock vLLM packed the CPU linears it cannot take weights, and the
  named variant runs (as in the trl section).
- colo.trl: the same script with `from colo.trl import GRPOTrainer` (TRL's loop on colo's engine).
- colo.grpo: `python -m colo.grpo`'s scheduler with the same tools, environment and batch
  (colo.grpo.agent: the rollouts' tools run on threads while the others decode).

Each side runs in a fresh process; per measured step (medians after a warm-up step): the step,
generation's seconds (all turns), the seconds the engine had nothing to decode while tools ran, and
the prompt tokens of every turn's request against those the engine computed (the rest: vLLM's prefix
cache). TRL's sides are measured by wrappers on its generate and on the tools; colo.grpo's from its
step record.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from .baselines import UPDATABLE_VARIANT
from .measure import engine_unavailable_reason, ratio, rows_per_device

SECTION = "agentic"
TOOL_LATENCY_S = 0.2
BATCH = dict(prompts=4, num_generations=2, max_completion_length=128)
WARMUP, STEPS = 1, 2
# Every turn is one well-formed call (a number as well would let the sides' samples call different
# numbers of tools); the second turn's call is not run: one round of tools.
CALL_REGEX = (r'<tool_call>\n\{"name": "(add", "arguments": \{"a": [1-9][0-9]{3,4}, "b": [1-9][0-9]{3,4}'
              r'|tally", "arguments": \{"amount": [1-9][0-9]{3,5})\}\}\n</tool_call>')


def add(a: int, b: int) -> int:
    """Add two whole numbers exactly.

    Args:
        a: the first number
        b: the second number
    """
    time.sleep(TOOL_LATENCY_S)
    return int(a) + int(b)


class Tally:
    """An environment: the rollout writes its answer to a tally; the episode scores 1 if it is right."""

    def reset(self, **row):
        self.answer, self.written = row.get("answer"), None

    def tally(self, amount: int) -> str:
        """Write the answer down.

        Args:
            amount: the answer
        """
        time.sleep(TOOL_LATENCY_S)
        self.written = str(amount)
        return "written"

    def get_reward(self) -> float:
        return float(self.written == self.answer)


def dataset():
    from datasets import Dataset

    from colo.grpo.arithmetic import tool_sums

    return Dataset.from_list(tool_sums(64, seed=0, show_call=True))


def tokenizer(model_dir):
    from transformers import AutoTokenizer

    from colo.grpo.tools import set_chat_template, tool_capable_template

    tok = AutoTokenizer.from_pretrained(model_dir)
    set_chat_template(tok, tool_capable_template("qwen2_5"))
    return tok


def run_trl(side: str, model_dir: Path, out: Path) -> dict:
    """TRL's agentic step, stock or with colo.trl: per measured step, its step_time, generation's
    seconds, the tools' seconds (the engine idle meanwhile: TRL runs them between turns) and the
    prompt tokens of every engine request against those served by the prefix cache."""
    import contextlib
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl
    from transformers.trainer_callback import PrinterCallback, TrainerCallback

    from colo.grpo.rewards import math_reward
    from colo.vllm_compat.forced_kernels import forced_cpu_gemm

    args = trl.GRPOConfig(output_dir=str(out), per_device_train_batch_size=BATCH["prompts"] * BATCH["num_generations"],
                          num_generations=BATCH["num_generations"], max_completion_length=BATCH["max_completion_length"],
                          max_steps=WARMUP + STEPS, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                          learning_rate=1e-6, save_strategy="no", seed=0, disable_tqdm=True,
                          vllm_max_model_length=1024, use_vllm=True, vllm_mode="colocate",
                          max_tool_calling_iterations=1, vllm_structured_outputs_regex=CALL_REGEX,
                          model_init_kwargs={"dtype": "float32"})
    if side.startswith("colo"):
        from colo.trl import GRPOTrainer
    else:
        GRPOTrainer = trl.GRPOTrainer
    with forced_cpu_gemm("plain") if side.endswith("variant") else contextlib.nullcontext():
        trainer = GRPOTrainer(model=str(model_dir), processing_class=tokenizer(model_dir), reward_funcs=[math_reward],
                              train_dataset=dataset(), args=args, tools=[add], environment_factory=Tally)
    trainer.remove_callback(PrinterCallback)
    steps, current = [], {}
    generation = trainer.vllm_generation
    real_generate, real_llm_generate = generation.generate, generation.llm.generate

    def generate(*a, **k):
        started = time.perf_counter()
        try:
            return real_generate(*a, **k)
        finally:
            current["generate_s"] = current.get("generate_s", 0.0) + time.perf_counter() - started

    def llm_generate(*a, **k):
        outputs = real_llm_generate(*a, **k)
        for o in outputs:
            current["in_context"] = current.get("in_context", 0) + len(o.prompt_token_ids)
            current["computed"] = current.get("computed", 0) + len(o.prompt_token_ids) - int(o.num_cached_tokens or 0)
        return outputs

    generation.generate, generation.llm.generate = generate, llm_generate
    real_call_loop = trainer._tool_call_loop

    def tool_loop(*a, **k):  # the engine is idle while TRL's loop runs the tools (minus its own generate)
        started, before = time.perf_counter(), current.get("generate_s", 0.0)
        try:
            return real_call_loop(*a, **k)
        finally:
            current["idle_s"] = current.get("idle_s", 0.0) + time.perf_counter() - started - \
                (current.get("generate_s", 0.0) - before)

    trainer._tool_call_loop = tool_loop

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(dict(current))

    trainer.add_callback(Steps())
    trainer.train()
    step_times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    calls = [h.get("tools/call_frequency", 0.0) for h in trainer.state.log_history if "step_time" in h]
    return {"step_s": step_times[WARMUP:], "phases": steps[WARMUP:], "calls": calls[WARMUP:],
            "sync_bytes": [r["bytes_copied"] for r in getattr(generation, "colo_sync_reports", [])][WARMUP:]}


def run_colo_grpo(model_dir: Path) -> dict:
    from colo.grpo import GRPOConfig, GRPOScheduler
    from colo.grpo.rewards import math_reward

    config = GRPOConfig(prompts_per_step=BATCH["prompts"], num_generations=BATCH["num_generations"],
                        max_new_tokens=BATCH["max_completion_length"], learning_rate=1e-6, save_every=0, max_turns=1,
                        chat_template="qwen2_5", structured_outputs_regex=CALL_REGEX, dtype="fp32")
    run = GRPOScheduler(model_dir, config=config, dataset=dataset(), reward_funcs=[math_reward], tools=[add],
                        environment_factory=Tally)
    try:
        records = [run.train_step() for _ in range(WARMUP + STEPS)][WARMUP:]
    finally:
        run.close()
    return {"step_s": [r["step_s"] for r in records], "records": records}


def _medians(phases: list[dict]) -> dict:
    return {key: statistics.median(p.get(key, 0) for p in phases) for key in ("generate_s", "idle_s", "in_context",
                                                                                 "computed")}


def measure(device: str, progress) -> list[dict]:
    from colo.smollm2 import smollm2_dir

    from .measure import in_fresh_process

    model = smollm2_dir()
    with tempfile.TemporaryDirectory(prefix="colo-agentic-") as tmp:
        tmp = Path(tmp)
        results, refused = {}, ""
        for side in progress(["stock", "colo", "grpo"], "agentic"):
            if side == "grpo":
                results[side] = in_fresh_process(run_colo_grpo, model)
                continue
            try:
                results[side] = in_fresh_process(run_trl, side, model, tmp / side)
            except Exception as e:  # noqa: BLE001 - stock TRL's crash is the finding; its variant runs instead
                if side != "stock":
                    raise
                refused = f"{type(e).__name__}: {e}"
                results["variant"] = in_fresh_process(run_trl, "variant", model, tmp / "variant")
    return agentic_rows(results, refused, device)


def agentic_rows(results: dict, refused: str, device: str) -> list[dict]:
    """The section's rows from each side's measurements: `results` holds run_trl's for "colo" and for
    "stock" (or "variant", where stock TRL raised `refused`), and run_colo_grpo's for "grpo"."""
    baseline = "variant" if refused else "stock"
    base, colo, grpo = results[baseline], results["colo"], results["grpo"]
    base_step = statistics.median(base["step_s"])
    base_phases, colo_phases = _medians(base["phases"]), _medians(colo["phases"])
    records = grpo["records"]
    grpo_phases = {"generate_s": statistics.median(r["generate_s"] for r in records),
                   "idle_s": statistics.median(r["engine_idle_during_tools_s"] for r in records),
                   "in_context": statistics.median(r["prefill_tokens_in_context"] for r in records),
                   "computed": statistics.median(r["prefill_tokens_computed"] for r in records)}
    base_name = f"stock TRL on {UPDATABLE_VARIANT}" if refused else "stock TRL (vLLM default mode)"
    note = (f"TRL 1.16 GRPOTrainer, tools=[add] + environment_factory=Tally, one round of tools, each call "
            f"{TOOL_LATENCY_S} s; SmolLM2-135M-Instruct, qwen2_5 template, 4-5 digit sums; guided decoding makes the "
            f"every turn a call (one round of them run); medians over {STEPS} steps after {WARMUP} warm-up step")
    if refused:
        note += f"; stock TRL cannot run here: it raised {refused[:300]}"

    def row(case, phases, step_s, **extra):
        return {"section": SECTION, "device": device, "case": case, "colo_s": step_s, "baseline": base_name,
                "baseline_s": base_step, "ratio": ratio(base_step, step_s),
                "colo_generate_s": phases["generate_s"], "baseline_generate_s": base_phases["generate_s"],
                "colo_engine_idle_during_tools_s": phases["idle_s"],
                "baseline_engine_idle_during_tools_s": base_phases["idle_s"],
                "colo_prefill_tokens_in_context": phases["in_context"], "colo_prefill_tokens_computed": phases["computed"],
                "baseline_prefill_tokens_in_context": base_phases["in_context"],
                "baseline_prefill_tokens_computed": base_phases["computed"],
                "baseline_tool_call_frequency": statistics.median(base["calls"]), **BATCH, "note": note, **extra}

    return [row("agentic step: colo.trl", colo_phases, statistics.median(colo["step_s"]),
                colo_tool_call_frequency=statistics.median(colo["calls"]),
                colo_sync_bytes=max(colo["sync_bytes"], default=0)),
            row("agentic step: colo.grpo scheduler", grpo_phases, statistics.median(grpo["step_s"]),
                colo_tool_call_frequency=statistics.median(r["tools/call_frequency"] for r in records),
                colo_sync_bytes=max(r["publish_bytes_copied"] for r in records))]


def _unavailable_reason(device: str) -> str:
    why = engine_unavailable_reason(device)
    if not why:
        try:
            import colo.trl  # noqa: F401 - checks the TRL release too
        except ImportError as e:
            why = str(e)
    if not why and device == "cuda":
        why = "the agentic section runs TRL on a CPU here; its GPU case has not been written"
    return why


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    return rows_per_device(SECTION, "agentic step", devices, _unavailable_reason,
                           lambda device: measure(device, progress))
