"""Agentic rollouts without an engine (colo.grpo.tools, colo.grpo.loss, colo.grpo.batch): tools checked
before anything starts, tool calls read in the template's format or the Hermes one, calls run off the
engine's thread with errors and timeouts as results, the template's tokens after a tool call, the loss
mask of tool tokens, and importance sampling's weights against a hand computation."""
from __future__ import annotations

import math
import time

import pytest
import torch

from colo.grpo.batch import pack
from colo.grpo.loss import importance_weights
from colo.grpo.tools import (ToolCall, ToolError, ToolRunner, check_environment, check_template_renders_tools,
                             check_tools, load_tool_object, parse_hermes, parse_turn, set_chat_template,
                             tool_capable_template, tool_suffix_ids)
from helpers.agentic import Counter, add, broken, crash, segfault, slow, slow_async


def no_hints(a, b):
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


class NoReset:
    def bump(self, by: int) -> int:
        """Add.

        Args:
            by: how much
        """
        return by


@pytest.fixture(scope="module")
def tokenizer(smollm2_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model_dir)
    set_chat_template(tok, tool_capable_template("qwen2_5"))
    return tok


def test_bad_tools_environments_and_templates_are_refused_by_name(tmp_path, smollm2_model_dir):
    assert set(check_tools([add])) == {"add"}
    with pytest.raises(ToolError, match="tool 'no_hints'.*type hints"):
        check_tools([no_hints])
    with pytest.raises(ToolError, match="tool 'no_docstring'"):
        check_tools([no_docstring])
    with pytest.raises(ToolError, match="two tools are named 'add'"):
        check_tools([add, add])
    check_environment(Counter)
    with pytest.raises(ToolError, match="environment NoReset has no reset"):
        check_environment(NoReset)
    with pytest.raises(ToolError, match="no file"):
        load_tool_object(str(tmp_path / "missing.py") + ":add")
    (tmp_path / "mine.py").write_text("def other(): pass\n")
    with pytest.raises(ToolError, match="has no 'add'"):
        load_tool_object(f"{tmp_path / 'mine.py'}:add")
    assert load_tool_object("colo.grpo.rewards:load_reward").__name__ == "load_reward"
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(smollm2_model_dir)  # SmolLM2's own template has no tools
    with pytest.raises(ToolError, match="the chat template of smol ignores `tools`"):
        check_template_renders_tools(own, [add], "of smol")
    with pytest.raises(ToolError, match="not a template TRL ships"):
        tool_capable_template("no_such_template")


def test_tool_calls_are_read_in_the_template_format_and_hermes(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3+4?"}], tools=[add],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    call = tokenizer('<tool_call>\n{"name": "add", "arguments": {"a": "3", "b": 4}}\n</tool_call><|im_end|>',
                     add_special_tokens=False)["input_ids"]
    turn = parse_turn(tokenizer, call, prompt, [add])
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 3, "b": 4})]  # typed from the schema
    assert turn.malformed is None and turn.message["role"] == "assistant" and turn.message["content"] == ""
    bad = tokenizer('<tool_call>\n{"name": "add", "arguments": {"a": 3,</tool_call><|im_end|>',
                    add_special_tokens=False)["input_ids"]
    assert parse_turn(tokenizer, bad, prompt, [add]).malformed
    text = tokenizer("It is 7.<|im_end|>", add_special_tokens=False)["input_ids"]
    plain = parse_turn(tokenizer, text, prompt, [add])
    assert plain.calls == [] and plain.malformed is None and plain.message["content"] == "It is 7."
    hermes = parse_hermes('ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert [(c.name, c.arguments) for c in hermes.calls] == [("add", {"a": 1, "b": 2})] and hermes.malformed is None
    assert parse_hermes("<tool_call>{not json}</tool_call>").malformed
    assert parse_hermes("<tool_call> never closed").malformed


def test_the_suffix_after_a_tool_call_is_the_templates_rendering_of_its_results(tokenizer):
    messages = [{"role": "tool", "name": "add", "content": "7"}]
    suffix = tool_suffix_ids(tokenizer, messages)
    assert tokenizer.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n" \
                                       "<|im_start|>assistant\n"
    # Token-exact: a conversation rendered whole is the turns' tokens one after the other.
    user = [{"role": "user", "content": "3+4?"}]
    prompt = tokenizer.apply_chat_template(user, tools=[add], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    turn = tokenizer('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
                     add_special_tokens=False)["input_ids"]
    whole = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]}] + messages,
        tools=[add], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert tokenizer.decode(prompt + turn + suffix) == tokenizer.decode(whole)


def test_tool_calls_run_off_thread_and_failures_become_results():
    runner = ToolRunner(timeout=0.3)
    tools = {"add": add, "broken": broken, "slow": slow, "slow_async": slow_async}
    try:
        calls = [runner.submit(ToolCall(name, args), tools) for name, args in
                 (("add", {"a": 2, "b": 5}), ("broken", {"x": 1}), ("missing", {}), ("add", {"c": 1}),
                  ("slow", {"x": 1}), ("slow_async", {"x": 1}))]
        started = time.perf_counter()
        while not all(c.ready(time.perf_counter()) for c in calls):
            time.sleep(0.01)
        assert time.perf_counter() - started < 1.5  # the deadline, not the sleeping tools, ended the wait
        results = [c.result(0.3) for c in calls]
    finally:
        runner.close()
    assert results[0].content == "7" and not results[0].failed
    assert results[1].failed and "the tool broke" in results[1].content
    assert results[2].failed and "Tool missing not found." in results[2].content
    assert results[3].failed and "unexpected keyword" in results[3].content
    assert results[4].timed_out and results[5].timed_out and "timed out after 0.3 s" in results[4].content


HUNG_TOOL_SCRIPT = """
import time
from colo.grpo.tools import ToolCall, ToolRunner
runner = ToolRunner(timeout=0.2, threads=2)
hung = [runner.submit(ToolCall("sleep", {}), {"sleep": lambda: time.sleep(3600)}) for _ in range(3)]
while not all(call.ready(time.perf_counter()) for call in hung):
    time.sleep(0.01)
assert all(call.result(0.2).timed_out for call in hung)
after = runner.submit(ToolCall("add", {"a": 1, "b": 2}), {"add": lambda a, b: a + b})
while not after.ready(time.perf_counter()):
    time.sleep(0.01)
print("RESULT", after.result(0.2).content, flush=True)
"""


def test_a_tool_that_never_returns_keeps_neither_the_pool_nor_the_process():
    """Three calls sleeping for an hour on a pool of two threads: each times out, a new call still runs
    (each stuck thread is replaced), and the process exits when its work is done, not in an hour."""
    import subprocess
    import sys

    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", HUNG_TOOL_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "RESULT 3" in done.stdout, done.stderr[-2000:]
    assert time.perf_counter() - started < 60


def test_tools_in_worker_processes_survive_crashes_hangs_and_errors():
    """--tool-isolation process: a tool that calls os._exit, one that segfaults and one that hangs past its
    deadline each end their worker (replaced), a raising one is an error result, and the same pool then
    runs more calls; a closure's captured value reaches the worker (cloudpickle)."""
    from colo.grpo.tool_workers import ToolWorkers

    offset = 100
    tools = {"add": add, "crash": crash, "segfault": segfault, "hang": slow, "broken": broken,
             "shifted": lambda x: x + offset}
    workers = ToolWorkers(tools, size=2)
    # A call's deadline counts from its submission, waiting for a worker (or a replacement's start-up)
    # included: the calls that must not time out get a generous one, the hanging tool 1 s once both
    # workers are up (on a loaded machine a fresh interpreter takes about a second to start).
    patient, strict = ToolRunner(timeout=60.0, workers=workers), ToolRunner(timeout=1.0, workers=workers)

    def run(runner, *calls):
        pending = [runner.submit(ToolCall(name, args), tools) for name, args in calls]
        while not all(c.ready(time.perf_counter()) for c in pending):
            time.sleep(0.01)
        return [c.result(1.0) for c in pending]

    try:
        results = run(patient, ("crash", {}), ("segfault", {}), ("broken", {"x": 1}), ("add", {"a": 2, "b": 5}),
                      ("shifted", {"x": 1}))
        run(patient, ("add", {"a": 0, "b": 0}), ("add", {"a": 0, "b": 0}))  # both replacements up and idle
        hung, = run(strict, ("hang", {"x": 1}))
        # The killed worker is replaced by its reader thread once the kill lands, and close() replaces no
        # worker: wait for that (or give up after a minute, and the count below fails).
        waited_until = time.perf_counter() + 60
        while workers.replaced < 3 and time.perf_counter() < waited_until:
            time.sleep(0.01)
        last, = run(patient, ("add", {"a": 1, "b": 1}))
    finally:
        patient.close()
        strict.close()
        workers.close()
    assert "worker process died (exit code 3)" in results[0].content
    assert "worker process died (exit code -11)" in results[1].content
    assert hung.timed_out and "the tool broke" in results[2].content
    assert results[3].content == "7" and results[4].content == "101" and last.content == "2"
    assert workers.replaced == 3  # the crashed, the segfaulted and the killed one


def test_tool_tokens_stay_in_the_sequence_and_out_of_the_loss():
    batch = pack([[5, 6]], [[7, 8, 9, 10, 11]], loss_masks=[[1, 1, 0, 0, 1]])
    assert batch.input_ids[0].tolist() == [5, 6, 7, 8, 9, 10, 11] and batch.attention_mask.sum() == 7
    assert batch.completion_mask.tolist() == [[1, 1, 0, 0, 1]] and batch.model_tokens.tolist() == [[1, 1, 0, 0, 1]]
    with pytest.raises(ValueError, match="loss mask entries"):
        pack([[5]], [[7, 8]], loss_masks=[[1]])


def test_importance_weights_match_a_hand_computation():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    engine = torch.tensor([[-1.5, -2.0, -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    token, stats = importance_weights(trainer, engine, mask, "token_truncate", None, 1.2)
    assert torch.allclose(token, torch.tensor([[min(math.exp(0.5), 1.2), 1.0, 1.0]]))
    assert stats["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)
    sequence, _ = importance_weights(trainer, engine, mask, "sequence_truncate", None, 3.0)
    assert torch.allclose(sequence, torch.tensor([[math.exp(0.5)]]))
    masked, stats = importance_weights(trainer, engine, mask, "sequence_mask", None, 1.5)
    assert masked.tolist() == [[0.0]] and stats["sampling/importance_sampling_ratio/max"] == 0.0
    kept, _ = importance_weights(trainer, engine, mask, "token_mask", 0.9, 1.5)
    assert torch.allclose(kept, torch.tensor([[0.0, 1.0, 1.0]]))  # exp(0.5) > 1.5: masked


def test_a_rollout_funcs_completion_is_truncated_unless_it_ends_a_sequence_and_missing_logprobs_stay_missing():
    """TRL's rule for rollout_func output: truncated (mask_truncated_completions) unless its last token is
    EOS or padding, whatever its length; a log-probability given as None is missing (NaN), not 0."""
    from types import SimpleNamespace

    from colo.grpo.agent import CustomRollouts

    task = SimpleNamespace(stop_token_ids=(2, 9), tokenizer=SimpleNamespace(pad_token_id=0),
                           decode=lambda rows: ["x" for _ in rows])
    rollouts = CustomRollouts(None, task, None, SimpleNamespace(max_new_tokens=4))
    out = {"prompt_ids": [[1]] * 4, "completion_ids": [[5, 6, 7], [5, 6, 7, 2], [5, 9], [5, 6, 7, 8]],
           "logprobs": [[-1.0, None, -1.0], [-1.0] * 4, [-1.0] * 2, [-1.0] * 4]}
    completions = rollouts._completions(out, 4)
    assert [c.truncated for c in completions] == [True, False, False, True]
    assert math.isnan(completions[0].logprobs[1]) and completions[0].logprobs[0] == -1.0
