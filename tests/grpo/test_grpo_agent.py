"""Agentic rollouts through the shared engine (colo.grpo.agent) on a real tokenizer: SmolLM2-135M-Instruct's
first two layers (its vocabulary, EOS and embeddings; the smollm2_two_layers_dir fixture) with TRL's
Qwen2.5 template (tool-capable, ChatML like SmolLM2's own), scripted tools, and guided decoding writing
the calls. What is trained on is the engine's tokens
turn by turn with the tools' results between them, masked out of the loss; the earlier turns come from
vLLM's prefix cache; tools that fail or hang are results, not crashes; environments reset per rollout."""
from __future__ import annotations

import json
import os
import time

import pytest

from colo.errors import EnvironmentFailed
from colo.grpo.agent import AgentRollouts
from colo.grpo.tools import tool_suffix_ids
from helpers.agentic import Counter, add, broken, slow
from helpers.forked import run_python
from helpers.logprobs import assert_engine_follows

pytestmark = pytest.mark.slow  # engines

CALL = r'<tool_call>\n\{{"name": "{name}", "arguments": \{{"{arg}": [1-9][0-9]{{0,3}}{more}\}}\}}\n</tool_call>'
ADD_CALL = CALL.format(name="add", arg="a", more=r', "b": [1-9][0-9]{0,3}')


def _dataset(n: int = 4):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {10 + i} + {20 + i}? Use add."}],
                               "answer": str(30 + 2 * i)} for i in range(n)])


def _correct(completions, answer, **kwargs):
    return [float(a in (c[-1].get("content") or "")) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def engine_and_tokenizer(smollm2_two_layers_dir):
    import colo
    from transformers import AutoTokenizer

    from colo.grpo.rollout_engine import RolloutEngine
    from colo.grpo.tools import set_chat_template, tool_capable_template

    tokenizer = AutoTokenizer.from_pretrained(smollm2_two_layers_dir)
    set_chat_template(tokenizer, tool_capable_template("qwen2_5"))
    engine = RolloutEngine(smollm2_two_layers_dir, colo.Pool("cpu"), seed=0, max_num_seqs=8, sequence_tokens=640,
                           max_model_len=1024, enforce_eager=True, skip_tokenizer_init=False)
    yield engine, tokenizer
    engine.close()


def _agent(engine, tokenizer, tools=(), environment=None, max_turns=1, max_new_tokens=160, timeout=None):
    from colo.grpo.task import DatasetTask

    task = DatasetTask(_dataset(), tokenizer, [_correct], tools=list(tools), environment=environment)
    agent = AgentRollouts(engine, task, tools={t.__name__: t for t in tools}, environment=environment,
                          max_turns=max_turns, tool_timeout=timeout, max_new_tokens=max_new_tokens,
                          max_model_len=engine.max_model_len)
    return agent, task


def _sampling(regex, n=2, max_tokens=160):
    return dict(n=n, max_tokens=max_tokens, temperature=1.0, seed=3, logprobs=0, stop_token_ids=[2],
                structured_outputs_regex=regex)


def test_turns_are_the_engines_tokens_with_the_tool_results_between_them(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    agent, task = _agent(engine, tokenizer, tools=[add], max_turns=1)
    groups = []
    completions = agent.generate([0, 1], [task.prompt_token_ids[0], task.prompt_token_ids[1]], [_sampling(ADD_CALL)] * 2,
                                 on_group=lambda i, c: groups.append((i, len(c))))
    agent.close()
    assert sorted(groups) == [(0, 2), (1, 2)] and len(completions) == 4
    for c in completions:
        assert c.turns == 2 and c.tool_calls == 1 and not c.truncated  # max_turns=1: one round of tools
        assert len(c.token_ids) == len(c.logprobs) == len(c.loss_mask)
        # The mask: the model's two turns (1), the tool's result between them (0), nothing else.
        runs = [c.loss_mask[0]] + [m for prev, m in zip(c.loss_mask, c.loss_mask[1:]) if m != prev]
        assert runs == [1, 0, 1]
        first = c.loss_mask.index(0)
        after = first + c.loss_mask[first:].index(1)
        call = c.messages[0]["tool_calls"][0]["function"]["arguments"]
        result = c.messages[1]
        assert result == {"role": "tool", "name": "add", "content": str(call["a"] + call["b"])}
        # The tool's tokens are the template's rendering of its result; the model's are what it sampled.
        assert c.token_ids[first:after] == tool_suffix_ids(tokenizer, [result])
        assert c.token_ids[first - 1] == tokenizer.eos_token_id and c.token_ids[-1] == tokenizer.eos_token_id
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
        assert all(lp < 0.0 or lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if m)
        # The second turn's request was the first turn's tokens and the result: the prefix cache served
        # the prompt and the first turn.
        assert c.prefill_in_context == 2 * len(c.prompt_ids) + after
        cached = c.prefill_in_context - c.prefill_computed
        assert cached >= (len(c.prompt_ids) + first) // engine.block_size * engine.block_size


def test_failing_and_hanging_tools_are_results_and_max_turns_bounds_the_loop(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    agent, task = _agent(engine, tokenizer, tools=[add, broken, slow], max_turns=2, max_new_tokens=400, timeout=0.5)
    prompts = [task.prompt_token_ids[0]]
    try:
        seen = {}
        for name in ("broken", "slow", "missing"):
            regex = CALL.format(name=name, arg="x", more="")
            completions = agent.generate([0], prompts, [_sampling(regex, n=1, max_tokens=400)])
            seen[name] = (completions[0], agent.stats.engine_idle_s)
        malformed = agent.generate([0], prompts, [_sampling(r"<tool_call>\n\{\"name\": \"add\"\n</tool_call>", n=1)])[0]
    finally:
        agent.close()
    for name, (c, _) in seen.items():
        assert c.turns == 3 and c.tool_calls == 2  # two rounds of tools (max_turns=2), then the loop ends
        assert [m["role"] for m in c.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert seen["broken"][0].tool_failures == 2 and "the tool broke" in seen["broken"][0].messages[1]["content"]
    assert seen["missing"][0].tool_failures == 2 and "Tool missing not found." in seen["missing"][0].messages[1]["content"]
    hung = seen["slow"][0]
    assert hung.timeouts == 2 and "timed out after 0.5 s" in hung.messages[1]["content"]
    assert 0.9 < seen["slow"][1] < 2.5  # waited for two 0.5 s deadlines, not for the 3 s tool twice
    assert malformed.malformed_calls == 2 and malformed.tool_calls == 0 and malformed.tool_failures == 0  # each round
    assert "could not be read" in malformed.messages[1]["content"]


def test_an_environment_per_rollout_its_reset_its_tools_and_its_reward(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    Counter.resets.clear()
    agent, task = _agent(engine, tokenizer, environment=Counter, max_turns=1)
    regex = CALL.format(name="bump", arg="by", more="")
    try:
        completions = agent.generate([2, 3], [task.prompt_token_ids[2], task.prompt_token_ids[3]],
                                     [_sampling(regex)] * 2)
    finally:
        agent.close()
    assert Counter.resets == ["34", "34", "36", "36"]  # reset(**row) before each rollout, with the row's columns
    environments = [c.environment for c in completions]
    assert len({id(e) for e in environments}) == 4  # one instance per rollout
    for c in completions:
        assert "(start from 3" in tokenizer.decode(c.prompt_ids)  # reset's string appended to the prompt
        bumped = c.messages[0]["tool_calls"][0]["function"]["arguments"]["by"]
        assert c.environment.count == bumped and c.messages[1]["content"] == str(bumped)
    scores = task.score(1, [2, 2, 3, 3], [c.prompt_ids for c in completions], [c.token_ids for c in completions],
                        conversations=[c.messages for c in completions], environments=environments)
    assert scores.names == ("_correct", "Counter")
    assert scores.per_function[:, 1].tolist() == [float(e.count) for e in environments]


def test_a_run_with_tools_and_an_environment_trains_overlapped_and_a_failing_reset_stops_it_with_the_checkpoint(
        tmp_path, smollm2_two_layers_dir):
    from colo.grpo import GRPOConfig, GRPOScheduler

    class FailsOnSecondStep(Counter):
        calls = 0

        def reset(self, **row):
            FailsOnSecondStep.calls += 1
            if FailsOnSecondStep.calls > 4:  # the second step's first rollout (2 prompts x 2 a step)
                raise KeyError("the environment's server went away")
            return super().reset(**row)

    either = CALL.format(name="(add|bump)", arg="(a|by)", more=r"(, \"b\": [1-9][0-9]{0,3})?")
    config = GRPOConfig(prompts_per_step=2, num_generations=2, max_new_tokens=160, learning_rate=1e-5, max_turns=1,
                        chat_template="qwen2_5", structured_outputs_regex=either + "|The answer is [0-9]+\\.",
                        save_every=1, overlap="on", seed=1)
    run = GRPOScheduler(smollm2_two_layers_dir, config=config, dataset=_dataset(), reward_funcs=[_correct], tools=[add],
                        environment_factory=FailsOnSecondStep, out_dir=tmp_path / "out",
                        engine_options=dict(enforce_eager=True))
    records = []
    try:
        with pytest.raises(EnvironmentFailed, match=r"FailsOnSecondStep.reset raised KeyError.*dataset row \d"):
            records.append(run.train_step())
            run.save()
            run.train_step()
    finally:
        run.close()
    record = records[0]
    assert record["overlap"] is True and record["turns_max"] <= 2 and record["tools/timeouts"] == 0
    assert 0 <= record["tools/rollouts_calling"] <= 1 and record["prefill_tokens_computed"] > 0
    assert "rewards/FailsOnSecondStep/mean" in record and record["loss"] == record["loss"]
    # The failed step changed nothing on disk: the first step's checkpoint is the newest.
    assert sorted(p.name for p in (tmp_path / "out").glob("step-*.pt")) == ["step-000001.pt"]


def test_rollout_func_generates_with_the_engine_and_its_fields_reach_the_rewards(smollm2_two_layers_dir):
    from colo.grpo import GRPOConfig, GRPOScheduler

    seen = {}

    def rollout(prompts, context):
        tok = context.processing_class
        ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for p in prompts]
        outs = context.vllm_generation.llm.generate([{"prompt_token_ids": i} for i in ids],
                                                    context.sampling_params(max_tokens=8), use_tqdm=False)
        completion = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        tail = tok("\nok", add_special_tokens=False)["input_ids"]  # an environment's tokens: context only
        return {"prompt_ids": ids, "completion_ids": [c + tail for c in completion],
                "logprobs": [lp + [0.0] * len(tail) for lp in logprobs],
                "env_mask": [[1] * len(c) + [0] * len(tail) for c in completion], "judge": [7] * len(ids)}

    def uses_judge(completions, judge, **kwargs):
        seen["judge"] = judge
        return [0.5] * len(completions)

    config = GRPOConfig(prompts_per_step=2, num_generations=2, max_new_tokens=16, learning_rate=1e-5, save_every=0)
    run = GRPOScheduler(smollm2_two_layers_dir, config=config, dataset=_dataset(), reward_funcs=[uses_judge],
                        rollout_func=rollout, engine_options=dict(enforce_eager=True))
    try:
        record = run.train_step()
    finally:
        run.close()
    assert seen["judge"] == [7, 7, 7, 7]
    assert_engine_follows(record)  # the env_mask kept the added tokens out of the comparison (several nats)
    assert record["completion_length_max"] <= 8


@pytest.mark.parametrize("flags, error", [
    (["--tool", "missing.py:add"], "--tool 'missing.py:add': no file missing.py"),
    (["--tool", "TOOLS:no_hints"], "tool 'no_hints' cannot be described to the model"),
    (["--environment", "TOOLS:NoReset"], "environment NoReset has no reset()"),
    (["--tool", "TOOLS:add"], "the chat template of MODEL ignores `tools`"),
])
def test_bad_agentic_flags_fail_before_any_engine_starts(tmp_path, smollm2_model_dir, flags, error):
    tools = tmp_path / "tools.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    '''Add.\n\n    Args:\n        a: one\n        b: two\n    '''\n"
                     "    return a + b\n\ndef no_hints(a):\n    '''x\n\n    Args:\n        a: one\n    '''\n\n"
                     "class NoReset:\n    pass\n")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    flags = [f.replace("TOOLS", str(tools)) for f in flags]
    started = time.perf_counter()
    done = run_python("colo.grpo", ["--steps", "1", "--json", str(tmp_path / "l.jsonl"), "--out", str(tmp_path / "o"),
                                    "--model", str(smollm2_model_dir), "--dataset", str(data), "--reward", "math", *flags],
                      dict(os.environ), cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert error.replace("MODEL", str(smollm2_model_dir)) in done.stderr
    assert time.perf_counter() - started < 60 and not (tmp_path / "o").exists()
