"""A stand-in for colo's RolloutEngine and DatasetTask, so that AgentRollouts.generate runs its real loop
(parse the turn, run the tools, render their results, queue the next turn) without vLLM or a model:
each request's turn is the tokens of the next scripted text.

    agent = AgentRollouts(ScriptedEngine(tokenizer, ['<tool_call>{"name": "add", ...}</tool_call>']),
                          ScriptedTask(tokenizer), tools={"add": add}, ...)
    completion, = agent.generate([0], [[1]], [{"n": 1, "seed": 0}])
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

LAST_TURN = "The answer is 3."   # what the model says once the script is spent: no tool call, the rollout ends


class ScriptedTask:
    """The few things AgentRollouts asks of its task: the tokenizer, a row's fields and its prompt."""

    def __init__(self, tokenizer):
        self.tokenizer, self.template_kwargs = tokenizer, {}

    def row_fields(self, row: int) -> dict:
        return {"prompt": "hi", "row": row}

    def describe_row(self, row: int) -> str:
        return f"row {row}"

    def prompt_ids_with(self, row: int, observation, tools=None) -> list[int]:
        return self.tokenizer("hi " + (observation or ""))["input_ids"]

    def decode(self, ids) -> list[str]:
        return [self.tokenizer.decode(i) for i in ids]


class ScriptedEngine:
    """Answers requests in order, each with the next of `turns` (then LAST_TURN), as a finished turn."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.queue, self._ids = tokenizer, list(turns), [], itertools.count()
        self.polls = 0   # unfinished() calls: the rollout loop asks once a round, so a loop that spins asks often

    def enqueue(self, prompts, sampling) -> list[str]:
        ids = [str(next(self._ids)) for _ in prompts]
        self.queue += list(zip(ids, prompts))
        return ids

    def unfinished(self) -> int:
        self.polls += 1
        return len(self.queue)

    def abort(self, ids) -> None:
        self.queue = [q for q in self.queue if q[0] not in ids]

    def step(self) -> list:
        request_id, prompt = self.queue.pop(0)
        text = self.turns.pop(0) if self.turns else LAST_TURN
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        sample = SimpleNamespace(token_ids=ids, logprobs=None, finish_reason="stop")
        return [SimpleNamespace(request_id=request_id, prompt_token_ids=prompt, num_cached_tokens=0, outputs=[sample])]
