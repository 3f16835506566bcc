"""colo.trl runs TRL 1.16's own agentic paths unchanged through colo's engine: `tools=` with
`environment_factory=` (TRL's tool loop, one generate call per turn) and `rollout_func=`; every weight
sync copies 0 bytes, and the KV cache stays awake across the turns of one generation (vLLM's prefix
cache keeps the earlier turns) and sleeps for training. The same script runs with stock TRL (on the
F.linear variant where stock vLLM cannot take weights) and logs the same tool counts.

SmolLM2-135M-Instruct's first two layers (its tokenizer, vocabulary and EOS; the smollm2_two_layers_dir
fixture) with TRL's Qwen2.5 template (tool-capable, ChatML like SmolLM2's own); guided decoding makes the
model write one well-formed call per turn, so both sides call the same number of tools. (Two layers: stock
TRL's engine compiles the model, which takes minutes for all 30 on 2 cores.)"""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from helpers.forked import run_python

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl", reason="colo.trl's tests need the trl extra: pip install -e '.[cpu,test]'")

SCRIPT = textwrap.dedent('''
    import json, os, sys
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    model, side, out, modes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = qwen2_5_chat_template
    add_response_schema(tok)
    CALLS = []

    def add(a: int, b: int) -> int:
        """Add two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        CALLS.append((a, b))
        return a + b

    class Counter:
        def reset(self, **row):
            self.count = 0
            return " (count with bump)"

        def bump(self, by: int) -> int:
            """Add to the counter.

            Args:
                by: how much
            """
            self.count += by
            return self.count

        def get_reward(self) -> float:
            return float(self.count)

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(8)]})
    call = r'<tool_call>\\n\\{"name": "(add", "arguments": \\{"a": [1-9], "b": [1-9]|bump", "arguments": \\{"by": [1-9])\\}\\}\\n</tool_call>'
    def run(mode):
        CALLS.clear()
        args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_completion_length=96,
                              max_steps=1, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                              save_strategy="no", seed=0, vllm_max_model_length=640, use_vllm=True, vllm_mode="colocate",
                              max_tool_calling_iterations=1, vllm_structured_outputs_regex=call,
                              vllm_gpu_memory_utilization=0.05,  # TRL's 0.3 is 7 GiB of a CI machine's 24 for KV
                              model_init_kwargs={"dtype": "float32"})
        if side == "colo":
            from colo.trl import GRPOTrainer
            options = {"colo_engine_options": {"enforce_eager": True}}
        else:
            from colo.vllm_compat.forced_kernels import forced_cpu_gemm
            GRPOTrainer, options = trl.GRPOTrainer, {}
        def rollout(prompts, trainer):  # TRL's rollout_func: the engine generates, an environment adds its tokens
            llm = trainer.vllm_generation.llm
            ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                   for p in prompts]
            from vllm import SamplingParams
            outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=8, logprobs=0),
                                use_tqdm=False)
            tail = tok("\\nok", add_special_tokens=False)["input_ids"]
            return {"prompt_ids": ids, "completion_ids": [list(o.outputs[0].token_ids) + tail for o in outs],
                    "logprobs": [[s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                 + [0.0] * len(tail) for o in outs],
                    "env_mask": [[1] * len(o.outputs[0].token_ids) + [0] * len(tail) for o in outs],
                    "judge": [7] * len(ids)}

        def judged(completions, judge, **kwargs):
            return [float(j) for j in judge]

        context = forced_cpu_gemm("plain") if side == "stock" else __import__("contextlib").nullcontext()
        with context:
            if mode == "tools":
                trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=length, train_dataset=data,
                                      args=args, tools=[add], environment_factory=Counter, **options)
            else:
                args.vllm_structured_outputs_regex = None
                trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=judged, train_dataset=data,
                                      args=args, rollout_func=rollout, **options)
        awake_at_turn = []
        if side == "colo":
            from colo.engine import kv_cache_region
            generation = trainer.vllm_generation
            real = generation.generate

            def watched(*a, **k):
                awake_at_turn.append(not kv_cache_region(generation.llm).asleep)
                return real(*a, **k)
            generation.generate = watched
        trainer.train()
        logged = next(h for h in trainer.state.log_history if "reward" in h)
        result = {"calls": len(CALLS), "logged": logged, "awake_at_turn": awake_at_turn}
        if side == "colo":
            from colo.engine import kv_cache_region
            result["syncs"] = [dict(r) for r in trainer.vllm_generation.colo_sync_reports]
            result["asleep_after"] = kv_cache_region(trainer.vllm_generation.llm).asleep
        open(os.path.join(out, f"result-{mode}.json"), "w").write(json.dumps(result))

    for mode in modes:  # one process for several runs: Python's, TRL's and vLLM's start-up paid once
        run(mode)
''')


def _run(side, model_dir, out, modes=("tools",)) -> dict:
    """{mode: its result} of the script's runs on one side, one process."""
    out.mkdir()
    script = out / "agentic_trl.py"
    script.write_text(SCRIPT)
    done = run_python(script, [str(model_dir), side, str(out), ",".join(modes)], dict(os.environ), cwd=out, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return {mode: json.loads((out / f"result-{mode}.json").read_text()) for mode in modes}


@pytest.fixture(scope="module")
def colo_runs(tmp_path_factory, smollm2_two_layers_dir) -> dict:
    """colo.trl's side of both tests, in one process."""
    return _run("colo", smollm2_two_layers_dir, tmp_path_factory.mktemp("agentic") / "colo", ("tools", "rollout_func"))


def test_trls_tool_loop_and_environments_run_on_colos_engine_as_on_stock_trl(tmp_path, smollm2_two_layers_dir,
                                                                            colo_runs):
    colo = colo_runs["tools"]
    stock = _run("stock", smollm2_two_layers_dir, tmp_path / "stock")["tools"]
    # TRL's loop ran on both: one call per completion in its first turn (max_tool_calling_iterations=1).
    for side in (colo, stock):
        assert side["calls"] <= 4 and side["logged"]["tools/call_frequency"] == pytest.approx(1.0)
        assert side["logged"]["tools/failure_frequency"] == 0.0 and "rewards/Counter/mean" in side["logged"]
    assert colo["logged"]["tools/call_frequency"] == stock["logged"]["tools/call_frequency"]
    # The turns of one generation found the KV cache awake (the earlier turns in vLLM's prefix cache);
    # TRL trained with it asleep; every sync copied 0 bytes.
    assert colo["awake_at_turn"][1:] and all(colo["awake_at_turn"][1:]) and colo["asleep_after"]
    assert colo["syncs"] and all(s["bytes_copied"] == 0 for s in colo["syncs"])


def test_a_trl_rollout_func_generates_on_colos_engine_and_its_fields_reach_the_rewards(colo_runs):
    result = colo_runs["rollout_func"]
    assert result["logged"]["rewards/judged/mean"] == 7.0  # the function's own field reached the reward
    assert result["logged"]["completions/max_length"] <= 8  # env_mask: the environment's tokens are not counted
    assert result["syncs"] and all(s["bytes_copied"] == 0 for s in result["syncs"]) and result["asleep_after"]
