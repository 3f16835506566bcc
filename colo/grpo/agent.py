"""Agentic rollouts through the shared engine: several turns, tools and environments (colo.grpo.tools).

A rollout is a list of turns. The model's turn is the engine's tokens (trained); the tools' results
follow as the chat template renders them (context only: masked out of the loss); then the model's
next turn, until it calls no tool, `max_turns` rounds of tools have run, or the token budget
(`max_new_tokens` for everything after the prompt, TRL's max_completion_length) is spent. Every turn's
prompt is the previous turn's tokens plus the tool results' tokens, so what is trained on is exactly
what the engine produced and read, and vLLM's prefix cache serves the earlier turns' KV (the record
counts the prompt tokens it computed against those in context).

The engine never waits on a tool: each rollout is its own request, a rollout whose turn called tools
steps aside while they run (colo.grpo.tools.ToolRunner: threads, or an event loop for async tools) and
the other rollouts go on decoding; its next turn is queued between engine steps once every call of
its turn has returned or timed out. A prompt's group is done when all its rollouts have ended their
last turn: on_group(i, completions) then runs, as for single-turn generation (colo.grpo.overlap trains
it while the others are still going).
"""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

from ..errors import EnvironmentFailed
from .overlap import GroupFailed
from .rollout_engine import Completion
from .tools import (PendingCall, ToolCall, ToolRunner, describe_error, environment_tools, parse_turn,
                    tool_suffix_ids)

MALFORMED = "tool_call"      # the name a malformed call's error result goes under
_TURN_SEED_STRIDE = 104_729  # each turn of a rollout samples with a seed of its own
_SEEDS = 2**63 - 1           # vLLM takes a seed that fits an int64
# A tool result's characters kept per token of max_new_tokens: a token rarely holds more, so a result cut
# there would not have fitted the budget anyway, and what is kept renders and tokenizes quickly.
RESULT_CHARS_PER_TOKEN = 8


@dataclass
class AgentCompletion(Completion):
    """A rollout's completion: every turn's tokens after the prompt, the model's and the tools'.

    prompt_ids: this rollout's prompt (an environment's reset() may have added to it);
    loss_mask: 1 for the model's tokens, 0 for the tools' (logprobs holds 0.0 there);
    messages: the turns as messages (assistant turns with their tool_calls, tool results): what reward
    functions get as `completion`, as in TRL; environment: the rollout's instance (None: no environment)."""
    prompt_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    environment: object = None
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    malformed_calls: int = 0
    timeouts: int = 0
    prefill_in_context: int = 0    # prompt tokens of every turn's request
    prefill_computed: int = 0      # of those, the ones the engine computed (the rest came from the prefix cache)
    extra: dict = field(default_factory=dict)  # a rollout_func's other fields for this row (for the rewards)


@dataclass
class AgentStats:
    """One generation's agentic figures (summed over its rollouts)."""
    engine_idle_s: float = 0.0     # time the engine had nothing to decode while tools ran
    tool_s: float = 0.0            # tool calls' own seconds, summed


class _Rollout:
    """One rollout in flight."""

    def __init__(self, index: int, prompt: list[int], tools: dict, environment, sampling: dict):
        self.index, self.prompt, self.tools, self.sampling = index, prompt, tools, sampling
        self.completion = AgentCompletion([], [], prompt_ids=prompt, environment=environment)
        self.pending: list[PendingCall] = []
        self.done = False

    @property
    def context(self) -> list[int]:
        return self.prompt + self.completion.token_ids


class AgentRollouts:
    """Generates multi-turn rollouts on `engine` (colo.grpo.rollout_engine.RolloutEngine).

    task: the colo.grpo.task.DatasetTask whose rows the prompts come from (its tokenizer renders and
    parses the turns); tools: {name: function} every rollout may call; environment: a class, one
    instance per rollout (None: none); max_turns: the most rounds of tool calls in a rollout (TRL's
    max_tool_calling_iterations); tool_timeout: seconds a call may take (None: no limit);
    max_new_tokens: every turn's tokens after the prompt together; max_model_len: the engine's; workers:
    the colo.grpo.tool_workers.ToolWorkers the sync tools run in (None: daemon threads)."""

    def __init__(self, engine, task, *, tools: dict, environment=None, max_turns: int, tool_timeout: float | None,
                 max_new_tokens: int, max_model_len: int, workers=None):
        self.engine, self.task, self.tools, self.environment = engine, task, dict(tools), environment
        self.max_turns, self.max_new_tokens, self.max_model_len = max_turns, max_new_tokens, max_model_len
        self.tool_timeout = tool_timeout
        self.runner = ToolRunner(tool_timeout, workers=workers, result_chars=RESULT_CHARS_PER_TOKEN * max_new_tokens)
        self._instances: list = []   # environment instances, reused across steps (reset before each rollout)
        self.stats = AgentStats()

    def generate(self, rows, prompts, sampling, *, on_group=None, trace=None) -> list[AgentCompletion]:
        """n rollouts per prompt (n = sampling[i]["n"]), group after group; on_group(i, completions) as
        soon as prompt i's rollouts have all ended."""
        self.stats = AgentStats()
        rollouts, groups = self._start(rows, prompts, sampling)
        done_groups: set[int] = set()
        by_request = dict(zip(self.engine.enqueue([r.prompt for r in rollouts],
                                                  [self._turn_sampling(r) for r in rollouts]), rollouts))
        if trace is not None:
            trace.start(len(rollouts))
        try:
            while not all(r.done for r in rollouts):
                if self.engine.unfinished():
                    for out in self.engine.step():
                        self._end_turn(by_request.pop(out.request_id), out)
                    if trace is not None:
                        trace.sample(sum(not r.done for r in rollouts))
                else:
                    self._wait_for_tools(rollouts)
                for rollout in rollouts:
                    if rollout.pending and all(p.ready(time.perf_counter()) for p in rollout.pending):
                        if self._tools_returned(rollout):
                            by_request.update(zip(self.engine.enqueue([rollout.context], [self._turn_sampling(rollout)]),
                                                  [rollout]))
                self._report_groups(groups, done_groups, on_group)
        except BaseException:
            self.engine.abort(list(by_request))
            for rollout in rollouts:
                for call in rollout.pending:
                    if call.future is not None:
                        call.future.cancel()
            raise
        return [r.completion for r in rollouts]

    # -- the rollouts' turns -------------------------------------------------------------------------
    def _start(self, rows, prompts, sampling) -> tuple[list[_Rollout], list[list[_Rollout]]]:
        """One rollout per completion, each with its tools (and environment instance, reset for its row)."""
        rollouts, groups = [], []
        for i, (row, prompt, options) in enumerate(zip(rows, prompts, sampling)):
            group = []
            for j in range(options["n"]):
                tools, environment = dict(self.tools), None
                if self.environment is not None:
                    environment = self._instance(len(rollouts))
                    prompt = self._reset(environment, row)
                    tools.update({name: getattr(environment, name) for name in environment_tools(self.environment)})
                seed = options.get("seed")
                one = {**options, "n": 1, **({"seed": (seed + j) % _SEEDS} if seed is not None else {})}
                group.append(_Rollout(len(rollouts), list(prompt), tools, environment, one))
                rollouts.append(group[-1])
            groups.append(group)
        return rollouts, groups

    def _instance(self, k: int):
        while len(self._instances) <= k:
            self._instances.append(self._construct())
        return self._instances[k]

    def _construct(self):
        """A new instance of the environment; its constructor failing is the user's code, not the engine's
        (GroupFailed: no rebuild), and named."""
        name = getattr(self.environment, "__name__", repr(self.environment))
        try:
            return self.environment()
        except (Exception, SystemExit) as e:  # SystemExit too: it would end the run without a word
            failed = EnvironmentFailed(f"environment {name}() raised {describe_error(e, with_type=True)} (each "
                                       f"rollout's instance is made as {name}(), TRL's environment_factory contract)")
            raise GroupFailed(str(failed)) from failed

    def _reset(self, environment, row: int) -> list[int]:
        """reset(**row) (TRL's contract): None, or a string appended to the last user message; the
        rollout's prompt tokens."""
        fields = self.task.row_fields(row)
        name = type(environment).__name__
        try:
            observation = environment.reset(**fields)
        except (Exception, SystemExit) as e:  # SystemExit too: it would end the run without a word
            failed = EnvironmentFailed(f"environment {name}.reset raised {describe_error(e, with_type=True)} on "
                                       f"{self.task.describe_row(row)}")
            raise GroupFailed(str(failed)) from failed  # the user's code, not the engine: no rebuild
        if observation is not None and not isinstance(observation, str):
            failed = EnvironmentFailed(f"environment {name}.reset returned a {type(observation).__name__} on "
                                       f"{self.task.describe_row(row)}; it must return None or a string")
            raise GroupFailed(str(failed)) from failed
        return self.task.prompt_ids_with(row, observation, tools=self._schemas_for(environment))

    def _schemas_for(self, environment) -> list:
        return [*self.tools.values(), *(getattr(environment, n) for n in environment_tools(type(environment)))]

    def _turn_sampling(self, rollout: _Rollout) -> dict:
        c = rollout.completion
        left = min(self.max_new_tokens - len(c.token_ids), self.max_model_len - len(rollout.context))
        options = {**rollout.sampling, "max_tokens": left}
        if c.turns and options.get("seed") is not None:
            options["seed"] = (options["seed"] + c.turns * _TURN_SEED_STRIDE) % _SEEDS
        return options

    def _end_turn(self, rollout: _Rollout, out) -> None:
        """A turn came back from the engine: keep its tokens, and run the tools it called (or end)."""
        c = rollout.completion
        sample = out.outputs[0]
        turn_ids = list(sample.token_ids)
        c.prefill_in_context += len(out.prompt_token_ids)
        c.prefill_computed += len(out.prompt_token_ids) - int(out.num_cached_tokens or 0)
        prefix = rollout.context
        c.token_ids += turn_ids
        c.logprobs += [step[t].logprob for step, t in zip(sample.logprobs, turn_ids)] if sample.logprobs else \
            [float("nan")] * len(turn_ids)   # (not given: importance sampling leaves them uncorrected, as TRL)
        c.loss_mask += [1] * len(turn_ids)
        c.turns += 1
        if sample.finish_reason == "length":  # out of budget mid-turn: whatever it was saying is cut
            c.truncated, rollout.done = True, True
            c.messages.append({"role": "assistant", "content": self.task.decode([turn_ids])[0]})
            return
        turn = parse_turn(self.task.tokenizer, turn_ids, prefix, list(rollout.tools.values()))
        c.messages.append(turn.message)
        if not (turn.calls or turn.malformed) or c.turns > self.max_turns:
            rollout.done = True
            return
        if turn.malformed:
            c.malformed_calls += 1
            bad = ToolCall(MALFORMED, {})
            rollout.pending.append(self.runner.submit(bad, {MALFORMED: _malformed(turn.malformed)}))
        for call in turn.calls:
            c.tool_calls += 1
            rollout.pending.append(self.runner.submit(call, rollout.tools))

    def _tools_returned(self, rollout: _Rollout) -> bool:
        """Every call of the rollout's turn returned (or timed out): their results join the context. True
        when the rollout goes on to another turn, False when the budget ends it here."""
        c = rollout.completion
        results = [call.result(self.tool_timeout) for call in rollout.pending]
        rollout.pending = []
        for result in results:
            if result.name != MALFORMED:
                c.tool_failures += result.failed
            c.timeouts += result.timed_out
            self.stats.tool_s += result.seconds
        messages = [r.message() for r in results]
        suffix = tool_suffix_ids(self.task.tokenizer, messages, self.task.template_kwargs)
        if len(c.token_ids) + len(suffix) >= self.max_new_tokens or \
                len(rollout.context) + len(suffix) >= self.max_model_len:
            # No room for the results and another turn (TRL rolls this round back the same way; the
            # tools have run).
            c.truncated, rollout.done = True, True
            return False
        c.token_ids += suffix
        c.logprobs += [0.0] * len(suffix)
        c.loss_mask += [0] * len(suffix)
        c.messages += messages
        return True

    def _wait_for_tools(self, rollouts: list[_Rollout]) -> None:
        """The engine has nothing to decode: wait (blocked, not spinning) until a call not yet ready returns
        or reaches its deadline. Calls already answered (an unknown tool, a fast one) do not count: their
        rollout still waits for its others. No wait where a rollout can go on already."""
        started = time.perf_counter()
        if any(r.pending and all(p.ready(started) for p in r.pending) for r in rollouts):
            return
        waiting = [p for r in rollouts for p in r.pending if not p.ready(started)]
        if not waiting:
            return
        deadlines = [d for d in (p.due() for p in waiting) if d is not None]
        wait = max(0.0, min(deadlines) - started) if deadlines else None
        concurrent.futures.wait([p.future for p in waiting], timeout=wait,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        self.stats.engine_idle_s += time.perf_counter() - started

    @staticmethod
    def _report_groups(groups, done_groups: set, on_group) -> None:
        for i, group in enumerate(groups):
            if i not in done_groups and all(r.done for r in group):
                done_groups.add(i)
                if on_group is not None:
                    on_group(i, [r.completion for r in group])

    def close(self) -> None:
        self.runner.close()   # the tool workers are the scheduler's to close (training and evaluation share them)


def _malformed(why: str):
    def tool_call():
        raise ValueError(f"the tool call could not be read ({why}); write "
                         '<tool_call>{"name": ..., "arguments": {...}}</tool_call>')
    return tool_call


class RolloutContext:
    """What a rollout_func gets beside the prompts, in place of TRL's trainer: the engine (`llm`, a vllm.LLM;
    also as `vllm_generation.llm`, where a TRL function looks for it), the tokenizer (`processing_class`),
    the run's config, the step, and `sampling_params(**overrides)`: the run's sampling settings as vLLM's
    SamplingParams (one completion, the engine's log-probabilities of the sampled tokens)."""

    def __init__(self, llm, tokenizer, config, step: int, stop_token_ids):
        self.llm, self.processing_class, self.config, self.step = llm, tokenizer, config, step
        self._stop = list(stop_token_ids)

    @property
    def vllm_generation(self):
        return self

    def sampling_params(self, **overrides):
        from vllm import SamplingParams

        c = self.config
        options = dict(n=1, max_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p, logprobs=0,
                       **({"top_k": c.top_k} if c.top_k else {}), **({"stop_token_ids": self._stop} if self._stop else {}))
        return SamplingParams(**{**options, **overrides})


class CustomRollouts:
    """A user's rollout_func (TRL's contract) as a step's generation. It gets the step's prompts (each row's
    `prompt` value, num_generations times, group after group) and a RolloutContext, and returns a dict
    with one entry per prompt under "prompt_ids", "completion_ids" (every turn's tokens, the model's and
    any others) and "logprobs" (the engine's for the model's tokens; any number for the others);
    optionally "env_mask" (1: the model's token, trained; 0: context only); every other key is a list
    with one value per row, or one value for all, given to the reward functions under its name."""

    REQUIRED = ("prompt_ids", "completion_ids", "logprobs")

    def __init__(self, engine, task, func, config):
        self.engine, self.task, self.func, self.config = engine, task, func, config
        self.stats = AgentStats()
        self.step = 0

    def generate(self, rows, prompts, sampling, *, on_group=None, trace=None) -> list[AgentCompletion]:
        n = sampling[0]["n"] if sampling else 1
        raw = [self.task.prompts[r] for r in rows for _ in range(n)]
        self.step += 1
        context = RolloutContext(self.engine.llm, self.task.tokenizer, self.config, self.step, self.task.stop_token_ids)
        if trace is not None:
            trace.start(len(raw))
        out = self.func(raw, context)
        completions = self._completions(out, len(raw))
        for i in range(len(rows)):
            if on_group is not None:
                on_group(i, completions[i * n:(i + 1) * n])
        return completions

    def _completions(self, out, count: int) -> list[AgentCompletion]:
        if not isinstance(out, dict):
            raise ValueError(f"rollout_func returned a {type(out).__name__}; it must return a dict with "
                             f"{', '.join(self.REQUIRED)}")
        missing = [k for k in self.REQUIRED if k not in out]
        if missing:
            raise ValueError(f"rollout_func's result lacks {', '.join(missing)} (TRL's contract: {', '.join(self.REQUIRED)})")
        masks = out.get("env_mask")
        for key in (*self.REQUIRED, *(("env_mask",) if masks is not None else ())):
            if len(out[key]) != count:
                raise ValueError(f"rollout_func returned {len(out[key])} {key} for {count} prompts (one per prompt, "
                                 "num_generations per row)")
        extra = {k: v for k, v in out.items() if k not in (*self.REQUIRED, "env_mask")}
        ends = self._end_tokens()
        completions = []
        for i in range(count):
            ids, logprobs = [int(t) for t in out["completion_ids"][i]], list(out["logprobs"][i])
            mask = [int(m) for m in masks[i]] if masks is not None else [1] * len(ids)
            if len(logprobs) != len(ids) or len(mask) != len(ids):
                raise ValueError(f"rollout_func row {i}: {len(ids)} completion ids, {len(logprobs)} logprobs"
                                 + (f", {len(mask)} env_mask entries" if masks is not None else "") + ": one each per token")
            completions.append(AgentCompletion(
                ids, [float("nan") if v is None else float(v) for v in logprobs], truncated=self._truncated(ids, ends),
                prompt_ids=[int(t) for t in out["prompt_ids"][i]], loss_mask=mask, turns=1,
                messages=[{"role": "assistant", "content": self.task.decode([ids])[0]}],
                extra={k: (v[i] if isinstance(v, (list, tuple)) and len(v) == count else v) for k, v in extra.items()}))
        return completions

    def _end_tokens(self) -> set[int]:
        pad = getattr(self.task.tokenizer, "pad_token_id", None)
        return {*self.task.stop_token_ids, *(() if pad is None else (int(pad),))}

    def _truncated(self, ids: list[int], ends: set[int]) -> bool:
        """TRL's rule for a rollout_func's completion: truncated unless its last token ends a sequence (EOS,
        the chat template's end of turn, or padding); by its length where no such token is known."""
        if not ends:
            return len(ids) >= self.config.max_new_tokens
        return bool(ids) and ids[-1] not in ends

    def close(self) -> None:
        pass
