"""Tools and environments for agentic rollouts, with TRL's conventions (TRL 1.16's GRPOTrainer `tools=`,
`environment_factory=`), so a TRL user's functions and classes work unchanged.

- A tool is a plain Python function, sync or async, with type hints and a Google-style docstring: its
  JSON schema is transformers' `get_json_schema`, given to the chat template as `tools=`. `--tool
  FILE.py:NAME` or `module:NAME` names one (`load_tool_object`).
- An environment is a class: one instance per rollout, `reset(**row)` before the rollout (None, or a
  string appended to the last user message), its public methods the rollout's tools, and an optional
  `get_reward()` scoring the finished episode (a reward of weight 1 named after the class).
- A turn's tool calls are parsed the way transformers parses the template's responses where the
  tokenizer has a response template (`tokenizer.parse_response`), and otherwise in the Hermes format,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A call that does not parse, an unknown
  tool, a tool that raises or one that runs past its timeout becomes an error in the tool's result
  message (as TRL writes it, `{'error': '...'}`) and is counted; the run goes on. That holds for whatever
  a tool raises (SystemExit, KeyboardInterrupt, an exception whose str() raises) and whatever the model
  writes (any JSON, any nesting, any length: calls are read by a linear scan). A result is cut to a bound
  (ToolRunner's `result_chars`), saying so, before anything renders or tokenizes it.
- `python` (`--tool colo.grpo.tools:python`) runs model-written Python in a sandbox (colo.grpo.sandbox).
- The next turn's tokens are the previous ones plus the template's rendering of the tool messages
  (`tool_suffix_ids`, TRL's way: the difference between two renderings of a dummy conversation), so the
  model's own tokens are never decoded and tokenized again.

Everything a user can get wrong is checked before any engine starts (`check_tools`,
`check_environment`, `check_template_renders_tools`), naming the tool, class or template.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import queue
import re
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_NESTING = 64       # JSON levels a tool call may nest: json.loads recurses once per level
RESULT_CHARS = 16_000       # a tool result's characters kept where the caller gives no bound of its own
_JSON_STRUCTURE = re.compile(r'[\[\]{}"\\]')   # the characters that open, close or escape JSON's levels and strings


class ToolError(ValueError):
    """A tool, an environment or a chat template that cannot be used, named, before the engine starts."""


# -- finding and checking --------------------------------------------------------------------------

def load_tool_object(spec: str, flag: str = "--tool"):
    """The object `spec` names: `path/to/file.py:NAME` or `package.module:NAME`; ToolError otherwise."""
    from .user_code import load_object

    try:
        return load_object(spec, flag)
    except ValueError as e:
        raise ToolError(str(e)) from e.__cause__


def python(code: str) -> str:
    """Run a Python program and return what it printed (stdout and stderr). It runs alone in a sandbox: no
    network, no other processes, no files outside its own directory, a few seconds of CPU at most.

    Args:
        code: the program's source code
    """
    from .sandbox import run_python

    return run_python(code).text


def tool_schema(tool) -> dict:
    """The JSON schema of a tool (transformers' get_json_schema), or ToolError naming the tool and what
    it lacks (type hints, a docstring, a description of an argument)."""
    from transformers.utils import get_json_schema

    name = getattr(tool, "__name__", repr(tool))
    if not callable(tool):
        raise ToolError(f"tool {name}: not a function")
    try:
        return get_json_schema(tool)
    except Exception as e:  # noqa: BLE001 - transformers raises its own parsing exceptions
        raise ToolError(f"tool {name!r} cannot be described to the model: {e} (a tool needs type hints on "
                        "every argument and a Google-style docstring with an Args: entry for each)") from e


def check_tools(tools) -> dict:
    """{name: tool} of a list of functions, each with a schema; names must be unique."""
    by_name = {}
    for tool in tools or ():
        tool_schema(tool)
        name = tool.__name__
        if name in by_name:
            raise ToolError(f"two tools are named {name!r}")
        if inspect.isasyncgenfunction(_unwrapped(tool)):
            raise ToolError(f"tool {name!r} is an async generator: a tool returns its result (give an async def that "
                            "returns it)")
        by_name[name] = tool
    return by_name


def check_picklable(tools: dict) -> None:
    """Refuse, by name, a tool that cannot reach a worker process (--tool-isolation process): cloudpickle
    cannot serialize what its closure or globals hold (a lock, a client, a tokenizer)."""
    import cloudpickle

    for name, tool in tools.items():
        try:
            cloudpickle.dumps(tool)
        except Exception as e:  # noqa: BLE001 - pickling raises TypeError, PicklingError, or the object's own
            raise ToolError(f"tool {name!r} cannot be sent to a worker process ({describe_error(e)}): make what it "
                            "holds inside the function, or give --tool-isolation thread to run it in the trainer "
                            "process") from e


def is_async_tool(tool) -> bool:
    """An `async def`, also behind a sync decorator (functools.wraps): its call returns a coroutine, which
    the event loop awaits; a thread would hand the model the coroutine's repr."""
    return inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(_unwrapped(tool))


def _unwrapped(tool):
    try:
        return inspect.unwrap(tool)
    except ValueError:  # a __wrapped__ cycle: the tool as it is
        return tool


def environment_tools(cls) -> list[str]:
    """The public methods of an environment class that are its tools (TRL: every function on the class
    whose name does not start with '_', except reset and get_reward)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


def check_environment(cls) -> None:
    """An environment class colo can use: a class with reset(), each public method a tool."""
    name = getattr(cls, "__name__", repr(cls))
    if not inspect.isclass(cls):
        raise ToolError(f"environment {name}: not a class (give --environment FILE.py:CLASS)")
    if not callable(getattr(cls, "reset", None)):
        raise ToolError(f"environment {name} has no reset() method (TRL's environment contract: reset(**row) "
                        "returns None or a string appended to the prompt)")
    if inspect.iscoroutinefunction(cls.reset):
        raise ToolError(f"environment {name}: reset() must be synchronous (it runs before the rollout's prompt is made)")
    needed = _required_arguments(cls)
    if needed:
        raise ToolError(f"environment {name}: its constructor needs {', '.join(needed)}; each rollout's instance is "
                        f"made as {name}() (TRL's environment_factory contract), so give every argument a default")
    for method in environment_tools(cls):
        try:
            tool_schema(getattr(cls, method))
        except ToolError as e:
            raise ToolError(f"environment {name}: {e}") from None


def _required_arguments(cls) -> list[str]:
    """The arguments `cls()` would lack."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a builtin's constructor: nothing known to check
        return []
    return [p.name for p in signature.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def check_template_renders_tools(tokenizer, tools: list, template_name: str) -> None:
    """Refuse a chat template that ignores `tools` (its prompt would not tell the model they exist)."""
    messages = [{"role": "user", "content": "hello"}]
    try:
        plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        with_tools = tokenizer.apply_chat_template(messages, tools=[tool_schema(t) for t in tools],
                                                   add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template error: name the template
        raise ToolError(f"the chat template {template_name} cannot render tools: {type(e).__name__}: {e}") from e
    if plain == with_tools:
        raise ToolError(f"the chat template {template_name} ignores `tools`: the model would never see them. Give a "
                        "tool-capable template, e.g. --chat-template qwen2_5 (TRL's Qwen2.5 template, ChatML like "
                        "SmolLM2's)")


def tool_capable_template(name_or_path: str) -> str:
    """The text of a chat template: a file's, or one TRL ships (trl.chat_template_utils: qwen2_5,
    qwen3, ...), by name."""
    path = Path(name_or_path)
    if path.suffix == ".jinja" or path.is_file():
        if not path.is_file():
            raise ToolError(f"--chat-template {name_or_path}: no such file")
        return path.read_text()
    try:
        from trl import chat_template_utils
    except ImportError as e:
        raise ToolError(f"--chat-template {name_or_path}: TRL's templates need TRL (pip install 'colo[trl]'), "
                        "or give a .jinja file") from e
    text = getattr(chat_template_utils, f"{name_or_path}_chat_template", None)
    if not isinstance(text, str):
        known = sorted(n[:-len("_chat_template")] for n in dir(chat_template_utils) if n.endswith("_chat_template"))
        raise ToolError(f"--chat-template {name_or_path}: not a template TRL ships ({', '.join(known)}) nor a .jinja file")
    return text


def set_chat_template(tokenizer, template: str) -> None:
    """Give the tokenizer `template`, and the response parser TRL pairs with it where it has one."""
    tokenizer.chat_template = template
    try:
        from trl.chat_template_utils import add_response_schema
    except ImportError:
        return  # no TRL: tool calls are read in the Hermes format
    try:
        add_response_schema(tokenizer)
    except ValueError:
        pass  # a template TRL has no parser for: the Hermes format


# -- a turn's tool calls ---------------------------------------------------------------------------

@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class Turn:
    """What one assistant turn said: its message (content, tool_calls as the template writes them), the
    calls to run, and why a call that was attempted could not be read (None: none such)."""
    message: dict
    calls: list[ToolCall] = field(default_factory=list)
    malformed: str | None = None


def parse_turn(tokenizer, turn_ids: list[int], prefix_ids: list[int], tools: list) -> Turn:
    """The assistant turn `turn_ids` (the engine's tokens), read after `prefix_ids` (what came before)."""
    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        try:
            message = tokenizer.parse_response(turn_ids, prefix=prefix_ids, tools=tools or None)
            calls = [_call(c) for c in message.get("tool_calls") or ()]
        except Exception as e:  # noqa: BLE001 - whatever the model wrote (RecursionError too) is a malformed call
            text = tokenizer.decode(turn_ids, skip_special_tokens=True)
            return Turn({"role": "assistant", "content": text}, malformed=_malformed_because(e))
        message = {"role": "assistant", **{k: v for k, v in message.items() if k != "role"}}
        message["content"] = message.get("content") or ""  # as TRL: a turn of tool calls only has content ""
        if isinstance(message["content"], str) and tokenizer.eos_token:
            message["content"] = message["content"].removesuffix(tokenizer.eos_token)
        return Turn(message, calls)
    return parse_hermes(tokenizer.decode(turn_ids, skip_special_tokens=True))


def parse_hermes(text: str) -> Turn:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in `text` (Qwen's, Hermes')."""
    calls, problems = [], []
    blocks, outside, unclosed = _hermes_blocks(text)
    for block in blocks:
        try:
            calls.append(_call({"function": _json(block)}))
        except Exception as e:  # noqa: BLE001 - whatever the model wrote (RecursionError too) is a malformed call
            problems.append(f"{_malformed_because(e)} in {block[:80]!r}")
    if unclosed and not blocks:
        problems.append("<tool_call> without </tool_call>")
    message = {"role": "assistant", "content": outside.strip()}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return Turn(message, calls, "; ".join(problems) or None)


def _hermes_blocks(text: str) -> tuple[list[str], str, bool]:
    """The bodies of the `<tool_call>...</tool_call>` blocks in `text` (stripped), the text outside them, and
    whether a block was left open. A scan with str.find, linear in the text whatever the model wrote: a
    regex skipping whitespace around a lazy group backtracks over a whitespace run after an unclosed tag
    from each of its positions."""
    blocks, outside, at = [], [], 0
    while True:
        start = text.find(HERMES_OPEN, at)
        end = text.find(HERMES_CLOSE, start + len(HERMES_OPEN)) if start >= 0 else -1
        if end < 0:  # no more blocks (or one never closed, which stays in the text, as the model wrote it)
            outside.append(text[at:])
            return blocks, "".join(outside), start >= 0
        outside.append(text[at:start])
        blocks.append(text[start + len(HERMES_OPEN):end].strip())
        at = end + len(HERMES_CLOSE)


def _json(text: str):
    """json.loads, refusing text nested deeper than MAX_CALL_NESTING before the decoder's recursion gets there."""
    if _nests_deeper(text, MAX_CALL_NESTING):
        raise ValueError(f"the JSON nests deeper than {MAX_CALL_NESTING} levels")
    return json.loads(text)


def _nests_deeper(text: str, most: int) -> bool:
    """Whether JSON `text` opens more than `most` levels at once (brackets inside strings do not count); one
    pass over its structural characters."""
    depth, in_string, escaped_at = 0, False, -1
    for match in _JSON_STRUCTURE.finditer(text):
        char, at = match.group(), match.start()
        if in_string:
            if at == escaped_at:
                continue
            if char == "\\":
                escaped_at = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > most:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _malformed_because(error: Exception) -> str:
    return describe_error(error, with_type=True)


def _call(raw) -> ToolCall:
    function = raw.get("function", raw) if isinstance(raw, dict) else raw
    if not isinstance(function, dict):
        raise TypeError(f"a tool call must be a JSON object with a name and arguments, got {type(function).__name__}")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str):
        raise TypeError(f"a tool call's name must be a string, got {name!r}")
    if isinstance(arguments, str):
        arguments = _json(arguments)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise TypeError(f"tool {name}: arguments must be an object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


def tool_suffix_ids(tokenizer, tool_messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The tokens the chat template puts after an assistant turn that called tools: the tool messages
    and the next assistant turn's header. TRL's way: render a dummy conversation up to the calling turn
    and again with the tool messages, and keep the difference (after the calling turn's end-of-turn
    token, which the engine already produced)."""
    kwargs = dict(template_kwargs or {})
    calls = [{"type": "function", "function": {"name": m.get("name", "tool"), "arguments": {}}} for m in tool_messages]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    before = _ids(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, **kwargs))
    after = _ids(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                               **kwargs))
    ends = [i for i, t in enumerate(before) if t == tokenizer.eos_token_id]
    if ends:
        before = before[:ends[-1] + 1]
    if after[:len(before)] != before:
        raise ToolError("the chat template renders a conversation differently once tool results follow it (it is not "
                        "prefix-preserving), so the next turn cannot extend the engine's tokens")
    return after[len(before):]


def _ids(rendered) -> list[int]:
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


# -- running the calls -----------------------------------------------------------------------------

@dataclass
class ToolResult:
    name: str
    content: str
    failed: bool = False
    timed_out: bool = False
    seconds: float = 0.0

    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


def _error(name: str, text: str, limit: int = RESULT_CHARS, **flags) -> ToolResult:
    return ToolResult(name, str({"error": _cut(text, limit)}), failed=True, **flags)


def describe_error(error: BaseException, with_type: bool = False) -> str:
    """`error` in words, as the model (or the user) reads it: its message (after its type's name
    `with_type`, and always for SystemExit and the like: "SystemExit: 3" says what "3" alone does not), or
    its type's name where it has none; never an error of its own, since a __str__ that raises is the
    tool's bug, not the run's."""
    name = type(error).__name__
    try:
        text = str(error)
    except BaseException:  # noqa: BLE001 - even a __str__ raising SystemExit: the type's name says enough
        return name
    if with_type or not isinstance(error, Exception):
        return f"{name}: {text}" if text else name
    return text or name


def _cut(text: str, limit: int) -> str:
    """`text`, or its start and a note saying it was cut: at most `limit` characters, the note included,
    so that cutting it again changes nothing."""
    if len(text) <= limit:
        return text
    note = f"\n[cut to {limit} characters: it had {len(text)}]"
    return text[:max(0, limit - len(note))] + note


def _content(value, limit: int):
    """A tool's value as its result message's content: a list as it is (content parts), anything else as
    its str(); cut to `limit` characters before anything renders or tokenizes it (tokenizing a huge result
    on the trainer's thread would stall every rollout, and its memory could end the run)."""
    if inspect.isasyncgen(value):
        raise TypeError("the tool returned an async generator, not a result")
    text = str(value)
    if len(text) <= limit:
        return value if isinstance(value, list) else text
    return _cut(text, limit)


class ToolFailed(Exception):
    """A tool's call raised (anything, SystemExit and KeyboardInterrupt included); its message is what the
    model reads, made where the tool ran."""


class DaemonThreads:
    """A pool of daemon threads running submitted calls. Unlike ThreadPoolExecutor's threads, which the
    interpreter joins at exit, these are not waited for: a tool call that never returns cannot keep a
    finished run's process alive. `abandon()` adds a thread for one stuck in a call past its deadline
    (Python cannot stop a thread), so the pool keeps `size` threads free for new calls."""

    def __init__(self, size: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._size, self._name, self._started = size, name, 0

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        while self._started < self._size:
            self._start()
        return future

    def abandon(self) -> None:
        self._size += 1

    def shutdown(self) -> None:
        """Idle threads end; queued calls are cancelled; a thread stuck in a call is left to the interpreter."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self._started):
            self._queue.put(None)

    def _start(self) -> None:
        self._started += 1
        threading.Thread(target=self._work, name=f"{self._name}_{self._started}", daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
                future.set_exception(e)


class ToolRunner:
    """Runs tool calls off the engine's thread, so no call blocks the engine's steps, and none keeps the
    process alive once the run is done: sync tools in worker processes where `workers`
    (colo.grpo.tool_workers.ToolWorkers) runs them, else on a pool of daemon threads; async ones on an
    event loop of their own. Each call has a deadline (`timeout` seconds, None: none): one past it gives
    an error result at once, and its worker process is killed (and replaced), its thread abandoned
    (Python cannot stop a thread: a new one takes its place in the pool), its coroutine cancelled.
    Whatever a tool raises is an error result, and every result is cut to `result_chars` characters."""

    MIN_RESULT_CHARS = 200   # room for a result's start and the note saying it was cut

    def __init__(self, timeout: float | None = None, threads: int = 16, workers=None,
                 result_chars: int = RESULT_CHARS):
        self.timeout = timeout
        self.workers = workers
        self.result_chars = max(result_chars, self.MIN_RESULT_CHARS)
        self._pool = DaemonThreads(threads, "colo-tool")
        self._loop = self._loop_thread = None
        self._loop_calls = _InFlight()   # the calls in flight on the current event loop

    def submit(self, call: ToolCall, tools: dict) -> "PendingCall":
        """Start one call; `tools` maps names to the rollout's callables."""
        started = time.perf_counter()
        tool = tools.get(call.name)
        if tool is None:
            return PendingCall.done(_error(call.name, f"Tool {call.name} not found."), started)
        deadline = started + self.timeout if self.timeout is not None else None
        if is_async_tool(tool):
            loop, calls = self._event_loop()
            future = asyncio.run_coroutine_threadsafe(self._run_async(tool, call), loop)
            calls.add(future)
            return PendingCall(call.name, future, started, deadline, result_chars=self.result_chars)
        if self.workers is not None and self.workers.runs(call.name, tool):
            future = self.workers.submit(call.name, call.arguments)
            # Its deadline counts from when a worker takes it: waiting for a free one is not the tool's time.
            begun = (lambda: self.workers.started(future)) if self.timeout is not None else None
            return PendingCall(call.name, future, started, None, lambda: self.workers.kill(future),
                               result_chars=self.result_chars, timeout=self.timeout, begun=begun)
        future = self._pool.submit(_run_sync, tool, call, self.result_chars)
        return PendingCall(call.name, future, started, deadline, self._pool.abandon, result_chars=self.result_chars)

    async def _run_async(self, tool, call: ToolCall):
        try:
            return await asyncio.wait_for(_run_coroutine(tool, call, self.result_chars), timeout=self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError from None

    def _event_loop(self):
        """The async tools' event loop and its calls in flight; a new one where a tool's own callback or
        task ended the last one's thread (raising SystemExit or KeyboardInterrupt into the loop)."""
        if self._loop is None or not self._loop_thread.is_alive():
            self._loop, self._loop_calls = asyncio.new_event_loop(), _InFlight()
            self._loop_thread = threading.Thread(target=_serve, args=(self._loop, self._loop_calls),
                                                 name="colo-tool-loop", daemon=True)
            self._loop_thread.start()
        return self._loop, self._loop_calls

    def close(self) -> None:
        self._pool.shutdown()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


class _InFlight:
    """The calls in flight on one event loop and, once a tool has ended the loop, why: a call added after
    that (its coroutine may have run, and ended the loop, before it was added) fails at once too."""

    def __init__(self):
        self._lock = threading.Lock()
        self._futures: set = set()
        self.stopped: BaseException | None = None

    def add(self, future) -> None:
        with self._lock:
            stopped = self.stopped
            if stopped is None:
                self._futures.add(future)
        if stopped is not None:
            _fail(future, stopped)
        else:
            future.add_done_callback(self._discard)

    def _discard(self, future) -> None:
        with self._lock:
            self._futures.discard(future)

    def stop(self, error: BaseException) -> None:
        with self._lock:
            self.stopped, futures = error, list(self._futures)
        for future in futures:
            _fail(future, error)


def _fail(future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass  # it finished meanwhile


def _serve(loop, calls: _InFlight) -> None:
    """Run the async tools' event loop; should a tool end it, fail its calls in flight at once (nothing
    would ever finish them: with no deadline the run would wait forever)."""
    try:
        loop.run_forever()
    except BaseException as e:  # noqa: BLE001 - a tool's, raised into the loop by one of its callbacks or tasks
        calls.stop(ToolFailed(f"the async tools' event loop stopped ({describe_error(e)}); later calls run on a "
                              "new one"))


def _run_sync(tool, call: ToolCall, result_chars: int):
    """A sync tool's call on a pool thread: its result's content, or ToolFailed. Whatever the tool raises
    is caught, SystemExit and KeyboardInterrupt too: on this thread they can only be the tool's (a Ctrl-C
    reaches the main thread), and left alone they would end the run without a word."""
    try:
        return _content(_settled(tool(**call.arguments)), result_chars)
    except BaseException as e:  # noqa: BLE001 - the model reads it
        raise ToolFailed(describe_error(e)) from None


def _settled(value):
    """A sync tool's value; an awaitable (an async function behind a wrapper that is_async_tool cannot see
    through) is run to its result on this thread, rather than handing the model its repr."""
    if inspect.isawaitable(value):
        return asyncio.run(_awaited(value))
    return value


async def _awaited(awaitable):
    return await awaitable


async def _run_coroutine(tool, call: ToolCall, result_chars: int):
    """An async tool's call, in a task of its own: its result's content, or ToolFailed. Caught here, inside
    the task: a task hands SystemExit and KeyboardInterrupt on to the event loop, which ends its thread
    and with it every later async call."""
    try:
        value = tool(**call.arguments)
        if inspect.isawaitable(value):   # an async def's coroutine (a sync wrapper may return it)
            value = await value
        return _content(value, result_chars)
    except (asyncio.CancelledError, GeneratorExit):
        raise  # its deadline (wait_for cancels it), or the coroutine closed unfinished (a stopped loop's, collected)
    except BaseException as e:  # noqa: BLE001 - the model reads it
        raise ToolFailed(describe_error(e)) from None


@dataclass
class PendingCall:
    """One call in flight; result() once done() (or past its deadline)."""
    name: str
    future: Future | None
    started: float
    deadline: float | None
    abandoned: Callable | None = None   # called when the call is given up while its thread still runs it
    result_chars: int = RESULT_CHARS    # the most characters of the result (a worker's value arrives uncut)
    timeout: float | None = None        # with `begun`: the deadline is `timeout` after the call began
    begun: Callable | None = None       # () -> when a worker took the call (perf_counter), None while it waits
    _result: ToolResult | None = None

    @classmethod
    def done(cls, result: ToolResult, started: float) -> "PendingCall":
        return cls(result.name, None, started, None, _result=result)

    def due(self) -> float | None:
        """When the call is given up: its deadline, or `timeout` after a worker took it (none while queued)."""
        if self.begun is None:
            return self.deadline
        began = self.begun()
        return None if began is None else began + self.timeout

    def ready(self, now: float) -> bool:
        due = self.due()
        return self._result is not None or self.future.done() or (due is not None and now >= due)

    def result(self, timeout_s: float | None) -> ToolResult:
        if self._result is None:
            self._result = self._outcome(timeout_s, time.perf_counter() - self.started)
        return self._result

    def _outcome(self, timeout_s: float | None, seconds: float) -> ToolResult:
        if not self.future.done():
            if not self.future.cancel() and self.abandoned is not None:
                self.abandoned()  # its thread is stuck in the call: the pool starts another
            return self._timed_out(timeout_s, seconds)
        if self.future.cancelled():
            return _error(self.name, f"Tool {self.name} was cancelled.", seconds=seconds)
        # Read, not raised: whatever the tool raised (SystemExit too) is the model's to read, not a crash.
        error = self.future.exception()
        if isinstance(error, TimeoutError):   # the event loop's deadline (a tool's own TimeoutError is a ToolFailed)
            return self._timed_out(timeout_s, seconds)
        if error is not None:
            return _error(self.name, describe_error(error), self.result_chars, seconds=seconds)
        try:
            content = _content(self.future.result(), self.result_chars)
        except Exception as e:  # noqa: BLE001 - a worker's value whose str() raises
            return _error(self.name, describe_error(e), self.result_chars, seconds=seconds)
        return ToolResult(self.name, content, seconds=seconds)

    def _timed_out(self, timeout_s: float | None, seconds: float) -> ToolResult:
        if self.begun is not None and self.begun() is None:   # given up before any worker took it
            return _error(self.name, f"Tool {self.name} timed out waiting for a free tool worker.", timed_out=True,
                          seconds=seconds)
        after = f" after {timeout_s:g} s" if timeout_s is not None else ""
        return _error(self.name, f"Tool {self.name} timed out{after}.", timed_out=True, seconds=seconds)
