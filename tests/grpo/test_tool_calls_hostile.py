"""What a model or a user's tool can do to the agentic loop, and what it must never do: a tool call that
is valid JSON but no object, nested a thousand levels deep, or whitespace after an unclosed tag; a huge
result; a tool or environment raising SystemExit, KeyboardInterrupt or an exception whose str() raises;
an environment's constructor failing; a slow call beside an answered one; an async tool behind a sync
wrapper; a tool that cannot be pickled. Each becomes an error result the model reads (or a named error
before or at the start), never an exception out of generate(), which the scheduler would take for the
engine's failure. No engine: tests/helpers/scripted_engine.py scripts the model's turns."""
from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from colo.errors import EnvironmentFailed
from colo.grpo.agent import AgentRollouts
from colo.grpo.overlap import GroupFailed
from colo.grpo.tools import (PendingCall, ToolCall, ToolError, ToolRunner, check_environment, check_picklable,
                             check_tools, describe_error, parse_hermes, parse_turn)
from helpers.agentic import add
from helpers.scripted_engine import ScriptedEngine, ScriptedTask

ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(smollm2_model_dir):
    """SmolLM2's own template: no response schema, so turns are read in the Hermes format."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_model_dir)


def settle(runner: ToolRunner, tools: dict, *calls, within: float = 10.0):
    """The results of `calls` run on `runner`, failing the test (not hanging it) if one never finishes."""
    pending = [runner.submit(ToolCall(name, arguments), tools) for name, arguments in calls]
    give_up = time.perf_counter() + within
    while not all(p.ready(time.perf_counter()) for p in pending):
        assert time.perf_counter() < give_up, "a tool call never finished"
        time.sleep(0.01)
    return [p.result(runner.timeout) for p in pending]


def rollout(tokenizer, turns, tools=None, environment=None, timeout=5.0, max_new_tokens=4000, engine=None):
    """One rollout of AgentRollouts.generate's real loop on the scripted turns (or on `engine`)."""
    agent = AgentRollouts(engine or ScriptedEngine(tokenizer, turns), ScriptedTask(tokenizer),
                          tools={"add": add} if tools is None else tools, environment=environment, max_turns=3,
                          tool_timeout=timeout, max_new_tokens=max_new_tokens, max_model_len=1 << 20)
    try:
        return agent.generate([0], [[1]], [{"n": 1, "seed": 0}])[0]
    finally:
        agent.close()


class ParsedTokenizer:
    """A tokenizer with a response schema whose parse_response returns `parsed` (or raises `raises`)."""
    response_schema, eos_token = {"stand-in": True}, None

    def __init__(self, parsed=None, raises: BaseException | None = None):
        self.parsed, self.raises = parsed, raises

    def parse_response(self, turn_ids, prefix=None, tools=None):
        if self.raises is not None:
            raise self.raises
        return self.parsed

    def decode(self, ids, skip_special_tokens=False):
        return "what the model wrote"


# -- P1: a call that is JSON but no object ----------------------------------------------------------

@pytest.mark.parametrize("body", ["42", "[1, 2]", '"add"', "null", "true"])
def test_a_call_that_is_json_but_no_object_is_a_malformed_call(body):
    turn = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert turn.calls == [] and "must be a JSON object" in turn.malformed


def test_a_parsed_response_whose_call_is_no_object_is_a_malformed_call():
    for calls in ([42], [[1]], ["add"], [{"type": "function", "function": 7}]):
        turn = parse_turn(ParsedTokenizer({"role": "assistant", "tool_calls": calls}), [1], [], [add])
        assert turn.calls == [] and "must be a JSON object" in turn.malformed
        assert turn.message["content"] == "what the model wrote"


def test_a_call_that_is_no_object_ends_the_turn_not_generation(tokenizer):
    completion = rollout(tokenizer, ["<tool_call>42</tool_call>"])
    assert completion.malformed_calls == 1 and completion.turns == 2
    assert "could not be read" in completion.messages[1]["content"]


# -- P2: nesting ------------------------------------------------------------------------------------

def test_deep_nesting_is_a_malformed_call_not_a_recursion_error():
    deep_block = "<tool_call>" + "[" * 1001 + "</tool_call>"
    deep_arguments = '<tool_call>{"name": "add", "arguments": ' + '{"a": ' * 1000 + "1" + "}" * 1001 + "</tool_call>"
    deep_string_arguments = '<tool_call>{"name": "add", "arguments": "' + "[" * 1001 + '"}</tool_call>'
    for text in (deep_block, deep_arguments, deep_string_arguments):
        turn = parse_hermes(text)
        assert turn.calls == [] and "nests deeper than" in turn.malformed
    # Brackets inside strings are no nesting, and escaped quotes do not end a string.
    text = '<tool_call>{"name": "add", "arguments": {"a": "' + "[" * 1001 + '\\"\\\\", "b": [[1]]}}</tool_call>'
    turn = parse_hermes(text)
    assert turn.malformed is None and turn.calls[0].arguments == {"a": "[" * 1001 + '"\\', "b": [[1]]}


def test_a_response_parser_raising_recursion_error_is_a_malformed_call():
    turn = parse_turn(ParsedTokenizer(raises=RecursionError("maximum recursion depth exceeded")), [1], [], [add])
    assert turn.calls == [] and turn.malformed.startswith("RecursionError")


def test_deep_nesting_ends_the_turn_not_generation(tokenizer):
    completion = rollout(tokenizer, ["<tool_call>" + "[" * 1001 + "</tool_call>"])
    assert completion.malformed_calls == 1 and "nests deeper than" in completion.messages[1]["content"]


# -- P3: linear-time reading ------------------------------------------------------------------------

def test_whitespace_after_an_unclosed_tag_is_read_in_linear_time():
    for tail in (" " * 1500, " \n" * 700, "<tool_call>x" * 3000):
        started = time.perf_counter()
        turn = parse_hermes("Let me add. <tool_call>" + tail)
        assert time.perf_counter() - started < 1.0
        assert turn.calls == [] and turn.malformed == "<tool_call> without </tool_call>"
        assert turn.message["content"] == ("Let me add. <tool_call>" + tail).strip()


def test_the_scan_reads_blocks_as_the_hermes_format_has_them():
    turn = parse_hermes('a <tool_call>\n {"name": "add", "arguments": {"a": 1}} \n</tool_call> b '
                        '<tool_call>{"name": "add", "arguments": {"b": 2}}</tool_call> c <tool_call> left open')
    assert [c.arguments for c in turn.calls] == [{"a": 1}, {"b": 2}] and turn.malformed is None
    assert turn.message["content"] == "a  b  c <tool_call> left open"
    assert len(turn.message["tool_calls"]) == 2


# -- R1: a huge result ------------------------------------------------------------------------------

def test_a_huge_result_is_cut_and_says_so_on_threads_and_the_event_loop():
    async def page_async() -> str:
        return "z" * (8 << 20)

    runner = ToolRunner(timeout=30, result_chars=1000)
    def fails() -> str:
        raise ValueError("e" * (1 << 20))

    tools = {"page": lambda: "x" * (64 << 20), "pages": lambda: ["y"] * (1 << 20), "page_async": page_async,
             "fails": fails}
    try:
        results = settle(runner, tools, ("page", {}), ("pages", {}), ("page_async", {}), ("fails", {}))
    finally:
        runner.close()
    for result in results:
        assert "[cut to 1000 characters: it had " in result.content
    assert [len(r.content) for r in results[:3]] == [1000] * 3 and not any(r.failed for r in results[:3])
    assert results[0].content.startswith("xxx") and results[1].content.startswith("['y', 'y'")
    assert results[3].failed and len(results[3].content) < 1100  # the error's text cut, then quoted


def test_a_workers_huge_result_is_cut_when_it_arrives():
    from colo.grpo.tool_workers import ToolWorkers

    tools = {"page": lambda: "x" * (16 << 20)}
    workers = ToolWorkers(tools, size=1)
    runner = ToolRunner(timeout=60, workers=workers, result_chars=1000)
    try:
        result, = settle(runner, tools, ("page", {}), within=60)
    finally:
        runner.close()
        workers.close()
    assert len(result.content) == 1000 and result.content.endswith(f"[cut to 1000 characters: it had {16 << 20}]")


def test_a_rollout_renders_a_huge_result_only_once_cut(tokenizer, monkeypatch):
    """The results reach the chat template at most RESULT_CHARS_PER_TOKEN characters per token of the
    budget long, whatever the tool returned."""
    from colo.grpo import agent

    rendered = []
    render = agent.tool_suffix_ids
    monkeypatch.setattr(agent, "tool_suffix_ids",
                        lambda tok, messages, kwargs: rendered.extend(m["content"] for m in messages) or
                        render(tok, messages, kwargs))

    def search(query: str) -> str:
        """Search.

        Args:
            query: what for
        """
        return "the answer is 42. " * (1 << 18)

    started = time.perf_counter()
    completion = rollout(tokenizer, ['<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'],
                         tools={"search": search}, max_new_tokens=100)
    assert time.perf_counter() - started < 5.0
    assert len(rendered) == 1 and len(rendered[0]) == agent.RESULT_CHARS_PER_TOKEN * 100
    assert "cut to 800 characters" in rendered[0]
    assert completion.truncated  # the cut result still does not fit 100 tokens: the rollout ends there


# -- E1: SystemExit and KeyboardInterrupt -----------------------------------------------------------

def exits() -> str:
    """Exit."""
    sys.exit(3)


def interrupts() -> str:
    """Interrupt."""
    raise KeyboardInterrupt


async def async_exits() -> str:
    """Exit from a coroutine."""
    raise SystemExit(4)


async def async_ok() -> str:
    """Fine."""
    return "ok"


async def ends_its_loop() -> str:
    """End the event loop from a callback of its own, then wait."""
    asyncio.get_running_loop().call_soon(sys.exit, 5)
    await asyncio.sleep(3600)
    return "never"


def test_a_tool_that_exits_or_interrupts_is_an_error_result_and_the_event_loop_lives_on():
    runner = ToolRunner(timeout=5)
    tools = {"exits": exits, "interrupts": interrupts, "async_exits": async_exits, "async_ok": async_ok}
    try:
        results = settle(runner, tools, ("exits", {}), ("interrupts", {}), ("async_exits", {}))
        after, = settle(runner, tools, ("async_ok", {}))
    finally:
        runner.close()
    assert all(r.failed and not r.timed_out for r in results)
    assert "SystemExit: 3" in results[0].content and "KeyboardInterrupt" in results[1].content
    assert "SystemExit: 4" in results[2].content and after.content == "ok"


def test_an_async_tool_that_ends_the_event_loop_fails_at_once_and_a_new_loop_runs_the_next_call():
    runner = ToolRunner(timeout=None)  # no deadline: only the loop's end can finish the call
    tools = {"ends_its_loop": ends_its_loop, "async_ok": async_ok}
    try:
        stopped, = settle(runner, tools, ("ends_its_loop", {}), within=5.0)
        after, = settle(runner, tools, ("async_ok", {}), within=5.0)
    finally:
        runner.close()
    assert stopped.failed and "event loop stopped (SystemExit: 5)" in stopped.content
    assert after.content == "ok"


class ExitingEnvironment:
    def reset(self, **row):
        return None

    def move(self, x: int) -> str:
        """Move.

        Args:
            x: where
        """
        sys.exit(0)


def test_an_environment_method_that_exits_is_an_error_result(tokenizer):
    completion = rollout(tokenizer, ['<tool_call>{"name": "move", "arguments": {"x": 1}}</tool_call>'],
                         tools={}, environment=ExitingEnvironment)
    assert completion.tool_failures == 1 and "SystemExit: 0" in completion.messages[1]["content"]


# -- E2: an exception whose str() raises ------------------------------------------------------------

class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("its __str__ raised")


def bad_str() -> str:
    """Raise an exception that cannot say what it is."""
    raise BadStr()


async def async_bad_str() -> str:
    """Raise an exception that cannot say what it is, from a coroutine."""
    raise BadStr()


class BadStrEnvironment(ExitingEnvironment):
    def move(self, x: int) -> str:
        """Move.

        Args:
            x: where
        """
        raise BadStr()


class BadStrReset:
    def reset(self, **row):
        raise BadStr()


def test_an_exception_whose_str_raises_is_named_by_its_type(tokenizer):
    assert describe_error(BadStr()) == "BadStr" and describe_error(SystemExit(2)) == "SystemExit: 2"
    runner = ToolRunner(timeout=5)
    try:
        results = settle(runner, {"bad_str": bad_str, "async_bad_str": async_bad_str},
                         ("bad_str", {}), ("async_bad_str", {}))
    finally:
        runner.close()
    assert [r.content for r in results] == ["{'error': 'BadStr'}"] * 2
    completion = rollout(tokenizer, ['<tool_call>{"name": "move", "arguments": {"x": 1}}</tool_call>'],
                         tools={}, environment=BadStrEnvironment)
    assert completion.tool_failures == 1 and "BadStr" in completion.messages[1]["content"]
    with pytest.raises(GroupFailed, match="environment BadStrReset.reset raised BadStr on row 0"):
        rollout(tokenizer, ["done"], tools={}, environment=BadStrReset)


# -- E3: an environment's constructor ---------------------------------------------------------------

class InitFails:
    def __init__(self):
        raise RuntimeError("no licence for the simulator")

    def reset(self, **row):
        return None


class InitExits(InitFails):
    def __init__(self):
        sys.exit(2)


class NeedsLevel:
    def __init__(self, level, seed=0):
        self.level = level

    def reset(self, **row):
        return None


def test_an_environment_whose_constructor_raises_stops_the_run_naming_it(tokenizer):
    for environment, said in ((InitFails, r"InitFails\(\) raised RuntimeError: no licence for the simulator"),
                              (InitExits, r"InitExits\(\) raised SystemExit: 2")):
        with pytest.raises(GroupFailed, match=said) as caught:
            rollout(tokenizer, ["done"], tools={}, environment=environment)
        assert isinstance(caught.value.__cause__, EnvironmentFailed)
    with pytest.raises(ToolError, match=r"environment NeedsLevel: its constructor needs level; .* NeedsLevel\(\)"):
        check_environment(NeedsLevel)


# -- L1: waiting, not spinning ----------------------------------------------------------------------

def slow(x: int) -> int:
    """Takes a second.

    Args:
        x: returned
    """
    time.sleep(1.0)
    return x


def test_the_loop_blocks_while_a_slow_call_runs_beside_an_answered_one(tokenizer):
    turn = ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>')
    engine = ScriptedEngine(tokenizer, [turn])
    started = time.perf_counter()
    completion = rollout(tokenizer, [], tools={"slow": slow}, timeout=10, engine=engine)
    assert completion.tool_calls == 2 and completion.tool_failures == 1 and time.perf_counter() - started >= 1.0
    assert engine.polls < 20, f"the loop went round {engine.polls} times while the slow tool slept"


def test_waiting_for_tools_blocks_on_the_calls_not_yet_answered_and_not_when_a_rollout_can_go_on():
    agent = AgentRollouts(None, None, tools={}, max_turns=1, tool_timeout=None, max_new_tokens=10, max_model_len=10)
    answered = ToolRunner().submit(ToolCall("nope", {}), {})   # an unknown tool: answered at once
    running: Future = Future()
    threading.Timer(0.3, running.set_result, ("late",)).start()
    started = time.perf_counter()
    agent._wait_for_tools([SimpleNamespace(pending=[answered, PendingCall("slow", running, started, None)])])
    assert running.done() and time.perf_counter() - started >= 0.25
    ready = SimpleNamespace(pending=[answered])
    never: Future = Future()
    started = time.perf_counter()
    agent._wait_for_tools([ready, SimpleNamespace(pending=[PendingCall("hang", never, started, None)])])
    assert time.perf_counter() - started < 0.2  # the first rollout can go on: no waiting for the other
    agent.close()


# -- C1: async tools behind sync wrappers -----------------------------------------------------------

def logged(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)
    return wrapper


@logged
async def fetch(url: str) -> str:
    """Fetch a page.

    Args:
        url: its address
    """
    await asyncio.sleep(0)
    return f"page at {url}"


async def pages(n: int):
    """Pages, one at a time.

    Args:
        n: how many
    """
    yield n


def test_an_async_tool_behind_a_sync_wrapper_is_awaited_and_an_async_generator_refused():
    assert set(check_tools([fetch])) == {"fetch"}
    with pytest.raises(ToolError, match="tool 'pages' is an async generator"):
        check_tools([pages])
    with pytest.raises(ToolError, match="tool 'pages' is an async generator"):
        check_tools([logged(pages)])
    hidden = lambda url: fetch.__wrapped__(url)  # noqa: E731 - a wrapper that does not say what it wraps
    refusing_workers = SimpleNamespace(runs=lambda name, tool: name == "fetch",
                                       submit=lambda name, arguments: pytest.fail("an async tool went to a worker"))
    runner = ToolRunner(timeout=5, workers=refusing_workers)
    try:
        results = settle(runner, {"fetch": fetch, "hidden": hidden, "pages": pages},
                         ("fetch", {"url": "a"}), ("pages", {"n": 1}))
        runner.workers = None
        hidden_result, = settle(runner, {"hidden": hidden}, ("hidden", {"url": "b"}))
    finally:
        runner.close()
    assert results[0].content == "page at a" and not results[0].failed
    assert results[1].failed and "async generator" in results[1].content
    assert hidden_result.content == "page at b"


# -- C2: a tool that cannot be pickled --------------------------------------------------------------

def test_a_tool_that_cannot_reach_a_worker_is_refused_by_name():
    lock = threading.Lock()

    def locked() -> str:
        """Use a lock."""
        with lock:
            return "ok"

    check_picklable({"add": add, "shifted": lambda x: x + 1})
    with pytest.raises(ToolError, match=r"tool 'locked' cannot be sent to a worker process \(cannot pickle "
                                        r"'_thread.lock' object\).*--tool-isolation thread"):
        check_picklable({"add": add, "locked": locked})


def test_a_call_added_after_its_loop_ended_fails_at_once():
    """The race a loaded machine shows: the tool's coroutine runs, and ends the loop, before the call is
    noted as in flight; noted after the loop's end, it fails at once rather than waiting for ever."""
    from concurrent.futures import Future

    from colo.grpo.tools import _InFlight

    calls, before, after = _InFlight(), Future(), Future()
    calls.add(before)
    calls.stop(RuntimeError("the loop ended"))
    calls.add(after)
    assert str(before.exception(timeout=1)) == str(after.exception(timeout=1)) == "the loop ended"
