"""colo's microbenchmarks: `python -m colo.bench`.

Each section is a module `colo.bench.<section>` with `run(quick, progress) -> list[dict]`
(docs/CONTRACTS.md). Every figure is measured beside the baseline a user would otherwise use,
in the same run, and reported with the ratio baseline_s / colo_s (>1 means colo is faster).

Nothing heavy is imported here, so `python -m colo.bench --help` stays instant.
"""

# In the order they run; the cheap pool sections first so their rows appear early.
SECTIONS = ("pool_alloc", "sleep_wake", "publish", "moe_publish", "grpo_step", "memory", "trl", "lora", "logprob_memory",
            "overlap", "agentic", "tool_calls")
# The module of each section whose name is also a module of colo's library (colo.trl, colo.lora,
# colo.grpo.overlap): every other section's module is its name.
SECTION_MODULES = {"trl": "trl_colocate", "lora": "lora_colocate", "overlap": "overlap_step"}
# `--quick` (the README's main job: minutes on a fresh 2-core machine) leaves out what only the full run
# needs to show; `--sections lora` (or agentic) runs it quick too.
QUICK_SECTIONS = tuple(name for name in SECTIONS if name not in ("lora", "agentic", "moe_publish"))
# The sections that run sides in fresh processes (measure.in_fresh_process), and those whose first
# seconds (building models and engines) time nothing and that wait for what was started beside them
# before they time (measure.wait_for_started_processes): the fork server of the fresh processes, which
# starts as the first of the latter begins, so that its imports overlap that set-up, and in a quick run
# the COMPILE_AHEAD of the sections after each (runner.fresh_process_plan). Nothing started beside a
# section outlives it.
FRESH_PROCESS_SECTIONS = ("trl", "lora", "logprob_memory", "agentic")
UNTIMED_SETUP_SECTIONS = ("publish", "grpo_step")
# What each section measures, and about how many seconds it took on 2 CPU cores with empty compile
# caches (quick: bench/results/cpu-quick-fresh-avx2.json, the AVX2 EPYC, rounded up; full: the full runs'
# files in bench/results), printed as it starts.
ABOUT = {
    "pool_alloc": ("Region.empty and the core's allocate/free against torch.empty and malloc", 1, 2),
    "sleep_wake": ("Region.sleep(offload) + wake against a copy to host and back", 5, 30),
    "publish": ("publish() on a compiled engine sharing the trainer's weights against TRL's load_weights sync",
                95, 420),
    "moe_publish": ("publish() on a 0.5B MoE whose experts are views of the engine's against TRL's load_weights "
                    "sync", 600, 600),
    "grpo_step": ("a colocated GRPO step against the usual way (own fp32 copy, per-parameter sync)", 85, 150),
    "memory": ("bytes per parameter resident in each phase, colo against the usual layout", 25, 130),
    "trl": ("TRL's GRPOTrainer with colo.trl against stock TRL colocate, in fresh processes", 50, 1300),
    "lora": ("LoRA with colo.trl and colo.grpo against stock TRL + PEFT", 110, 620),
    "logprob_memory": ("peak memory of chunked log-probabilities against all logits at once", 10, 280),
    "overlap": ("a GRPO step training finished groups during generation against the serial step", 25, 600),
    "tool_calls": ("a tool call in a worker process against one on a thread of the training process", 2, 5),
    "agentic": ("an agentic step (tools, an environment, two turns) with colo.trl and colo.grpo against stock TRL",
                400, 400),
}

DEVICE_CHOICES = ("cpu", "cuda", "all")

__all__ = ["SECTIONS", "SECTION_MODULES", "QUICK_SECTIONS", "FRESH_PROCESS_SECTIONS", "UNTIMED_SETUP_SECTIONS", "ABOUT",
           "DEVICE_CHOICES"]
