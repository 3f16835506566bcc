"""What a GRPO run trains on: prompts for each step, and the rewards of their completions.

Two kinds, one interface for the scheduler:

- `DatasetTask`: a user's dataset (a `prompt` column of text or {role, content} messages; message
  prompts go through the model's chat template) and reward functions with TRL's signature
  (colo.grpo.rewards); completions are decoded with the model's tokenizer and stop at its EOS and
  chat end tokens.
- `CallableTask`: the token-level API (prompt_fn(step, count) -> token id lists, reward_fn(prompts,
  completions) -> floats), which the toy task uses.

Every step's prompts depend only on (seed, step), so a resumed run sees the prompts the interrupted
one would have seen. The scheduler's set-up is here too: the task built from what a user gave it, the
engine's sequence length fitted to the prompts, a step's prompts checked, its sampling settings. A reward function that raises, or returns the wrong length, NaN or a
non-number, stops the run with a `RewardError` naming the function, the step and the prompt.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from . import distributed
from .images import VIDEO_COLUMNS, ImagePrompt, ImagePrompts, image_column, row_images
from .rewards import reward_name

PROMPT = "prompt"
# Columns TRL passes to reward functions under their own names, never as dataset columns.
RESERVED = ("prompt", "completion", "completion_ids", "prompts", "completions")
# Chat end tokens of common templates; a run stops at the ones its template uses (besides EOS).
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<end_of_utterance>")


class RewardError(ValueError):
    """A reward function failed or returned something that is not one reward per completion."""


@dataclass
class Scores:
    per_function: torch.Tensor   # (completions, functions) float32; NaN where a function returned None
    weights: torch.Tensor        # (functions,)
    names: tuple[str, ...]

    @property
    def total(self) -> torch.Tensor:
        """The weighted sum over functions (None counted as nothing); NaN where every one was None."""
        total = (self.per_function * self.weights).nansum(dim=1)
        total[torch.isnan(self.per_function).all(dim=1)] = math.nan
        return total


def _awaited(awaitables: list) -> list:
    """Each awaitable's result (or the exception it raised), awaited together in an event loop of their
    own (in a thread of its own where this thread already runs one)."""
    import asyncio

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def check_reward_call(function, columns: list[str], dataset: str, more_fields: bool = False) -> None:
    """Refuse, before any engine starts, a reward function TRL's call cannot reach: one whose parameters
    cannot take prompts=, completions=, completion_ids= and every column of the dataset by name, or one
    needing a column the dataset lacks (the math and gsm8k rewards' `solution` / `answer`). more_fields:
    the call may bring more (a rollout_func's fields): a parameter no column fills is not refused."""
    from .rewards import reward_name

    name = reward_name(function)
    needed = getattr(function, "needs_one_of_columns", None)
    if needed and not set(needed) & set(columns):
        raise ValueError(f"reward function {name!r} needs a {' or '.join(repr(c) for c in needed)} column; {dataset} "
                         f"has {', '.join(columns) or 'no other column than prompt'}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):   # a builtin or a C callable: its call is tried at the first step
        return
    call = {k: [] for k in ("prompts", "completions", "completion_ids", *columns)}
    try:
        (signature.bind_partial if more_fields else signature.bind)(**call)
    except TypeError as e:
        raise ValueError(f"reward function {name!r} cannot take TRL's call (prompts=, completions=, completion_ids= "
                         f"and each column of {dataset} by name: {', '.join(columns) or 'none'}): {e}; give it "
                         "**kwargs to take the columns it does not use") from None


def check_rewards(values, expected: int, function: str, step: int) -> list[float]:
    """One finite float or None per completion, or a RewardError saying what came back instead."""
    try:
        if isinstance(values, (str, bytes)):   # (a string has a length, and each character a float)
            raise TypeError
        count = len(values)
    except TypeError:
        raise RewardError(f"reward function {function!r} returned a {type(values).__name__} at step {step}; "
                          f"it must return a list of {expected} numbers (None to skip one)") from None
    if count != expected:
        raise RewardError(f"reward function {function!r} returned {count} rewards for {expected} completions at "
                          f"step {step}; it must return one per completion")
    checked = []
    for i, value in enumerate(values):
        if value is None:
            checked.append(math.nan)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward function {function!r} returned {value!r} for completion {i} at step {step}: "
                              "not a number (None to skip a completion)") from None
        if not math.isfinite(number):
            raise RewardError(f"reward function {function!r} returned {number} for completion {i} at step {step}: "
                              "rewards must be finite (None to skip a completion)")
        checked.append(number)
    return checked


class Task:
    """The interface the scheduler uses (see the module doc)."""

    reward_names: tuple[str, ...] = ("reward",)
    stop_token_ids: tuple[int, ...] = ()

    def batch(self, step: int, count: int) -> tuple[list[int], list[list[int]]]:
        """(rows, prompt token ids) of a step's `count` prompts; rows identify them to score()."""
        raise NotImplementedError

    def longest_prompt(self) -> int | None:
        """Tokens of the longest prompt this task can give, when known up front."""
        return None

    def placeholder_token_ids(self) -> list[int]:
        """Tokens the engine must not sample (a vision-language model's image placeholders)."""
        return []

    def score(self, step: int, rows: list[int], prompt_ids: list[list[int]],
              completion_ids: list[list[int]]) -> Scores:
        raise NotImplementedError

    def describe_row(self, row: int) -> str:
        return f"prompt {row}"


class CallableTask(Task):
    """prompt_fn(step, count) -> token id lists; reward_fn(prompts, completions) -> one float each."""

    def __init__(self, prompt_fn, reward_fn):
        self.prompt_fn, self.reward_fn = prompt_fn, reward_fn
        self.reward_names = (reward_name(reward_fn),)

    def batch(self, step, count):
        prompts = self.prompt_fn(step, count)
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompt_fn({step}, {count}) must return a list of {count} prompts, got "
                             f"{type(prompts).__name__}")
        return list(range(len(prompts))), [list(p) for p in prompts]

    def score(self, step, rows, prompt_ids, completion_ids):
        name = self.reward_names[0]
        try:
            values = self.reward_fn(prompt_ids, completion_ids)
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e} at step {step}") from e
        values = check_rewards(values, len(completion_ids), name, step)
        return Scores(torch.tensor(values, dtype=torch.float32).unsqueeze(1), torch.ones(1), self.reward_names)


class DatasetTask(Task):
    """A dataset's prompts and reward functions with TRL's signature, through the model's tokenizer.

    dataset: a `datasets.Dataset` (or anything colo.hub.load_dataset_file reads) with a `prompt` column.
    reward_funcs: functions (or their names, colo.grpo.rewards.load_reward); reward_weights: one per
    function (default 1 each). max_prompt_length: None refuses nothing here (the scheduler checks
    prompt + completion against the model); a number refuses longer prompts, naming the row, or with
    truncate="left" keeps their last tokens. Rows are taken in a fresh seeded shuffle every epoch.
    tools: functions the chat template describes to the model in every prompt (colo.grpo.tools);
    environment: a class whose instances' reset() may add to a rollout's prompt and whose get_reward(),
    where it has one, is one more reward function (weight 1, named after the class), as in TRL.
    vision_model_dir: a vision-language model's directory (None: a text-only model). A dataset with an
    `image` or `images` column (TRL's names) needs one: each row's images go into its chat prompt
    through the model's processor (colo.grpo.images), and a step's prompts are ImagePrompts (token ids
    with the engine's input and the processor's tensors).
    """

    def __init__(self, dataset, tokenizer, reward_funcs, reward_weights=None, *, seed: int = 0,
                 chat_template_kwargs: dict | None = None, max_prompt_length: int | None = None,
                 truncate: str | None = None, name: str = "dataset", tools=(), environment=None,
                 vision_model_dir=None):
        from ..hub import load_dataset_spec
        from .rewards import load_reward

        self.name, self.seed, self.tokenizer = name, seed, tokenizer
        self.dataset = load_dataset_spec(dataset) if isinstance(dataset, (str, Path)) else \
            rows_as_dataset(dataset, name)
        columns = list(self.dataset.column_names)
        if PROMPT not in columns:
            raise ValueError(f"{name} has no {PROMPT!r} column (it has {', '.join(columns) or 'none'}); TRL's "
                             "convention: a `prompt` column of text or of {role, content} messages")
        if len(self.dataset) == 0:
            raise ValueError(f"{name} has no rows")
        if truncate not in (None, "left"):
            raise ValueError(f"truncate must be None or 'left', got {truncate!r}")
        funcs = [load_reward(f) if isinstance(f, str) else f for f in _as_list(reward_funcs or [])]
        if environment is not None and callable(getattr(environment, "get_reward", None)):
            funcs.append(environment_reward(environment))
            if reward_weights is not None:
                reward_weights = [*reward_weights, 1.0]
        if not funcs:
            raise ValueError("a dataset task needs at least one reward function (or an environment with get_reward)")
        for f in funcs:
            if not callable(f):
                raise ValueError(f"reward function {f!r} is not callable")
        weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
        if len(weights) != len(funcs):
            raise ValueError(f"{len(weights)} reward weights for {len(funcs)} reward functions")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite numbers, got {weights}")
        given = [c for c in columns if c not in RESERVED] + (["environments"] if environment is not None else [])
        for f in funcs:   # (a library user's rollout_func may bring more fields: TRL's extra keys)
            check_reward_call(f, given, name, more_fields=True)
        self.reward_funcs = funcs
        self.reward_names = tuple(reward_name(f) for f in funcs)
        self.weights = torch.tensor(weights, dtype=torch.float32)
        # Plain lists: a datasets Column reads Arrow on every index, and rewards index them per row.
        self.prompts = list(self.dataset[PROMPT])
        self.conversational = _is_conversational(self.prompts[0])
        # Images are read when a row is used (undecoded here: a bad file is then an error naming its row).
        self.columns = {c: list(undecoded_images(self.dataset, c)[c]) for c in columns if c not in RESERVED}
        self.tools, self.environment = list(tools), environment
        self.template_kwargs = dict(chat_template_kwargs or {})
        if (self.tools or environment is not None) and not self.conversational:
            raise ValueError(f"{name}'s prompts are text: tools and environments need chat prompts ({{role, content}} "
                             "messages), which the chat template renders with the tools' descriptions")
        self.image_column, self.vision_model_dir = image_column(columns), vision_model_dir
        videos = [c for c in VIDEO_COLUMNS if c in columns]
        if videos and vision_model_dir is not None:
            raise NotImplementedError(f"{name} has a `{videos[0]}` column: video rows are not supported yet (images "
                                      "only, in an `image` or `images` column)")
        self._check_images(truncate)
        self.image_prompts = ImagePrompts(vision_model_dir) if self.image_column is not None else None
        self.max_prompt_length, self.truncate = max_prompt_length, truncate
        self.prompt_token_ids = self._tokenize(self.template_kwargs, max_prompt_length, truncate)
        self.stop_token_ids = tuple(stop_token_ids(tokenizer, chat=self.conversational))

    def _check_images(self, truncate) -> None:
        if self.image_column is None:
            return
        if self.vision_model_dir is None:
            raise ValueError(f"{self.name} has an `{self.image_column}` column but the model is text-only (its config "
                             "has no vision tower): images need a vision-language model")
        if not self.conversational:
            raise ValueError(f"{self.name} has an `{self.image_column}` column but its prompts are text: images go "
                             "into chat prompts ({role, content} messages), as in TRL")
        if self.tools or self.environment is not None:
            raise NotImplementedError("tools and environments with images (several turns of a vision-language model)")
        if truncate is not None:
            raise ValueError("truncate_prompts with images would cut image placeholders out of a prompt: raise "
                             "max_prompt_length instead")

    def _image_prompt(self, row: int) -> ImagePrompt:
        where = self.describe_row(row)
        if not _is_conversational(self.prompts[row]):
            raise ValueError(f"{where}: prompt is not a list of {{role, content}} messages like row 0's")
        return self.image_prompts.render(self.prompts[row], self._images(row), where, self.template_kwargs)

    def _images(self, row: int) -> list:
        return row_images(self.columns[self.image_column][row], self.image_column, self.describe_row(row))

    def _tokenize(self, template_kwargs, max_prompt_length, truncate) -> list[list[int]]:
        tok = self.tokenizer
        if self.image_column is not None:  # the processor's tensors are made again when a row is batched
            ids = [list(self._image_prompt(row)) for row in range(len(self.prompts))]
        elif self.conversational:
            if not getattr(tok, "chat_template", None):
                raise ValueError(f"{self.name}'s prompts are messages but the tokenizer has no chat template")
            ids = []
            for row, messages in enumerate(self.prompts):
                if not _is_conversational(messages):
                    raise ValueError(f"{self.name} row {row}: prompt is not a list of {{role, content}} messages "
                                     f"like row 0's: {_not_messages(messages)}")
                ids.append(self._render(messages, self._tool_schemas(), template_kwargs))
        else:
            for row, text in enumerate(self.prompts):
                if not isinstance(text, str):
                    raise ValueError(f"{self.name} row {row}: prompt is a {type(text).__name__}, not text"
                                     + (" like row 0's" if row else "")
                                     + (f" nor {{role, content}} messages ({_not_messages(text)})"
                                        if isinstance(text, list) else ""))
            ids = [list(x) for x in tok(list(self.prompts))["input_ids"]]
        for row, x in enumerate(ids):
            if not x:
                raise ValueError(f"{self.name} row {row}: the prompt has no tokens")
            if max_prompt_length is not None and len(x) > max_prompt_length:
                if truncate != "left":
                    raise ValueError(f"{self.name} row {row}: prompt of {len(x)} tokens is longer than "
                                     f"max_prompt_length={max_prompt_length} (truncate it with "
                                     "--truncate-prompts left, or raise the limit)")
                ids[row] = x[-max_prompt_length:]
        return ids

    def _render(self, messages, tools, template_kwargs) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                       tokenize=True, return_dict=True, **template_kwargs)["input_ids"])

    def _tool_schemas(self, extra=()) -> list[dict]:
        from .tools import environment_tools, tool_schema

        env = [getattr(self.environment, n) for n in environment_tools(self.environment)] if self.environment else []
        return [tool_schema(t) for t in [*self.tools, *env, *extra]]

    def row_fields(self, row: int) -> dict:
        """The dataset row as TRL hands it to an environment's reset(**row): the prompt and every column."""
        return {PROMPT: self.prompts[row], **{name: values[row] for name, values in self.columns.items()}}

    def prompt_ids_with(self, row: int, observation: str | None, tools) -> list[int]:
        """The row's prompt tokens with `observation` appended to its last message (TRL's rule for the
        string an environment's reset() returns), rendered with `tools` described."""
        if observation is None:
            return self.prompt_token_ids[row]
        messages = [dict(m) for m in self.prompts[row]]
        messages[-1]["content"] = f"{messages[-1]['content']}{observation}"
        from .tools import tool_schema

        ids = self._render(messages, [tool_schema(t) for t in tools], self.template_kwargs)
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length and self.truncate == "left":
            ids = ids[-self.max_prompt_length:]
        return ids

    def rows(self, step: int, count: int) -> list[int]:
        """The rows of a step: position k of the run is row perm_epoch[k % len], epoch = k // len."""
        n = len(self.prompt_token_ids)
        out, cache = [], {}
        for k in range((step - 1) * count, step * count):
            epoch = k // n
            if epoch not in cache:
                cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            out.append(int(cache[epoch][k % n]))
        return out

    def batch(self, step, count):
        rows = self.rows(step, count)
        if self.image_column is not None:
            return rows, [self._image_prompt(r) for r in rows]
        return rows, [self.prompt_token_ids[r] for r in rows]

    def placeholder_token_ids(self) -> list[int]:
        """Tokens the engine must not sample (a vision-language model's image placeholders)."""
        return self.image_prompts.placeholder_ids if self.image_prompts is not None else []

    def longest_prompt(self):
        return max(len(x) for x in self.prompt_token_ids)

    def describe_row(self, row):
        return f"{self.name} row {row}"

    def decode(self, completion_ids: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    def score(self, step, rows, prompt_ids, completion_ids, *, conversations=None, environments=None,
              extra_columns=None):
        """conversations: each completion's turns as messages (agentic rollouts: what TRL's reward functions
        get as `completion`), else each is decoded as one assistant message; environments: each
        completion's environment instance (passed as `environments=`, as TRL does); extra_columns: more
        keyword arguments for the reward functions, a value per completion (a rollout_func's fields)."""
        prompts = [self.prompts[r] for r in rows]
        if conversations is not None:
            completions = conversations
        elif self.conversational:
            completions = [[{"role": "assistant", "content": t}] for t in self.decode(completion_ids)]
        else:
            completions = self.decode(completion_ids)
        columns = {name: [values[r] for r in rows] for name, values in self.columns.items()}
        if self.image_column is not None:  # PIL images, as TRL's reward functions get them
            images = [self._images(r) for r in rows]   # an `image` column's text-only rows: None
            columns[self.image_column] = images if self.image_column == "images" else [(i or [None])[0] for i in images]
        if environments is not None:
            columns["environments"] = environments
        columns.update(extra_columns or {})
        call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        results = [self._called(function, name, call, rows, step)
                   for function, name in zip(self.reward_funcs, self.reward_names)]
        # Async reward functions (TRL's, as its own): awaited together, after the others.
        waiting = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
        if waiting:
            for i, values in zip(waiting, _awaited([results[i] for i in waiting])):
                if isinstance(values, BaseException):
                    raise RewardError(f"reward function {self.reward_names[i]!r} raised {type(values).__name__}: "
                                      f"{values} at step {step}") from values
                results[i] = values
        per_function = [check_rewards(values, len(completion_ids), name, step)
                        for values, name in zip(results, self.reward_names)]
        values = torch.tensor(per_function, dtype=torch.float32).T.contiguous()
        return Scores(values, self.weights, self.reward_names)

    def _called(self, function, name: str, call: dict, rows: list[int], step: int):
        try:
            return function(**call)
        except Exception as e:
            where = self._first_failing_row(function, call, rows)
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e} at step {step}{where}") from e

    def _first_failing_row(self, function, call: dict, rows: list[int]) -> str:
        """Which prompt made `function` raise: call it on one completion at a time (rewards are cheap
        next to a step; this runs only on the way to stopping the run)."""
        for i, row in enumerate(rows):
            one = {k: v[i:i + 1] for k, v in call.items()}
            try:
                function(**one)
            except Exception:  # noqa: BLE001 - the row is what we are looking for
                return f", on {self.describe_row(row)} (completion {i} of the {len(rows)} it was scoring)"
        return ""


def environment_reward(environment):
    """TRL's reward of an environment class: each rollout's instance's get_reward() (None: unscored)."""
    def get_reward(environments=None, **kwargs):
        return [e.get_reward() if isinstance(e, environment) else None for e in environments or ()]

    get_reward.__name__ = environment.__name__
    return get_reward


def stop_token_ids(tokenizer, chat: bool) -> list[int]:
    """EOS (the tokenizer's and the generation config's) and, for chat prompts, the end-of-turn token
    the chat template writes."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    template = getattr(tokenizer, "chat_template", None) or ""
    if chat:
        for token in CHAT_END_TOKENS:
            if token in template:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                    ids.append(token_id)
    return sorted(set(ids))


def undecoded_images(dataset, column: str):
    """The dataset, with `column` read as stored ({bytes, path}) where it is a datasets Image feature."""
    import datasets

    feature = getattr(dataset, "features", {}).get(column) if hasattr(dataset, "features") else None
    if isinstance(feature, datasets.Image) and feature.decode:
        return dataset.cast_column(column, datasets.Image(decode=False))
    if isinstance(feature, datasets.Sequence) and isinstance(feature.feature, datasets.Image):
        return dataset.cast_column(column, datasets.Sequence(datasets.Image(decode=False)))
    if isinstance(feature, list) and feature and isinstance(feature[0], datasets.Image):
        return dataset.cast_column(column, [datasets.Image(decode=False)])
    return dataset


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _is_conversational(prompt) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))


def _not_messages(prompt) -> str:
    """What keeps `prompt` from being chat messages, in words."""
    if not isinstance(prompt, list):
        return f"it is a {type(prompt).__name__}"
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            return f"message {i} is a {type(m).__name__}"
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            return f"message {i} lacks {' and '.join(missing)} (it has {', '.join(map(str, m)) or 'nothing'})"
    return "it is empty" if not prompt else "its messages are not all {role, content}"


# -- the scheduler's set-up and per-step checks ----------------------------------------------------

def rows_as_dataset(dataset, name: str = "dataset"):
    """A datasets.Dataset as given; a list of row dicts as one (datasets.Dataset.from_list); anything else
    refused, naming what it is."""
    if hasattr(dataset, "column_names"):
        return dataset
    if isinstance(dataset, (list, tuple)) and all(isinstance(row, dict) for row in dataset):
        import datasets

        return datasets.Dataset.from_list(list(dataset))
    raise TypeError(f"{name} must be a path, a hub name, a datasets.Dataset or a list of row dicts, "
                    f"got {type(dataset).__name__}")


def build_tasks(config, model_dir, task, dataset, reward_funcs, reward_weights, eval_dataset, tokenizer, prompt_fn,
                reward_fn, tools=(), environment=None) -> tuple[Task, Task | None]:
    """The scheduler's training task (and eval one) from what it was given, checked before any engine
    starts; with tools or an environment (agentic rollouts) every one of them and the chat template too."""
    given = [name for name, value in (("task", task), ("dataset", dataset), ("prompt_fn", prompt_fn))
             if value is not None]
    if len(given) != 1:
        raise ValueError("give the scheduler one of: dataset (with reward_funcs), prompt_fn (with reward_fn), "
                         f"or task; got {', '.join(given) or 'none'}")
    if eval_dataset is not None and dataset is None:
        raise ValueError("eval_dataset needs a dataset task (dataset and reward_funcs)")
    if config.eval_every and eval_dataset is None:
        raise ValueError(f"eval_every={config.eval_every} needs an eval_dataset")
    if config.eval_on_start and eval_dataset is None:
        raise ValueError("eval_on_start needs an eval_dataset")
    agentic = bool(tools) or environment is not None
    if agentic and dataset is None:
        raise ValueError("tools and environments need a dataset task (chat prompts, through the model's tokenizer "
                         "and chat template)")
    if task is not None:
        return task, None
    if prompt_fn is not None:
        if reward_fn is None:
            raise ValueError("prompt_fn needs a reward_fn")
        return CallableTask(prompt_fn, reward_fn), None
    rewarding_environment = environment is not None and callable(getattr(environment, "get_reward", None))
    if reward_funcs is None and not rewarding_environment:
        raise ValueError("a dataset needs reward_funcs (TRL's reward functions, or names: colo.grpo.rewards), or an "
                         "environment with get_reward()")
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir)
    if agentic or config.chat_template:
        _prepare_tool_template(config, tokenizer, model_dir, tools, environment)
    options = dict(seed=config.seed, chat_template_kwargs=config.chat_template_kwargs,
                   max_prompt_length=config.max_prompt_length, truncate=config.truncate_prompts, tools=tools,
                   environment=environment, vision_model_dir=model_dir if vision_language(model_dir) else None)
    train = DatasetTask(dataset, tokenizer, reward_funcs, reward_weights, name="dataset", **options)
    evaluation = None
    if eval_dataset is not None:
        user = len(train.reward_funcs) - rewarding_environment  # the environment's reward is added again
        evaluation = DatasetTask(eval_dataset, tokenizer, train.reward_funcs[:user], train.weights.tolist()[:user],
                                 name="eval dataset", **options)
    return train, evaluation


def vision_language(model_dir) -> bool:
    from transformers import AutoConfig

    from ..shared import is_vision_language

    return is_vision_language(AutoConfig.from_pretrained(model_dir))


def _prepare_tool_template(config, tokenizer, model_dir, tools, environment) -> None:
    """The tokenizer's chat template (config.chat_template's, where given), checked to describe the tools."""
    from .tools import check_environment, check_template_renders_tools, check_tools, environment_tools
    from .tools import set_chat_template, tool_capable_template

    check_tools(tools)
    if environment is not None:
        check_environment(environment)
    template_name = f"of {model_dir}"
    if config.chat_template:
        set_chat_template(tokenizer, tool_capable_template(config.chat_template))
        template_name = repr(config.chat_template)
    described = [*tools, *([getattr(environment, n) for n in environment_tools(environment)] if environment else [])]
    if described:
        check_template_renders_tools(tokenizer, described, template_name)


def load_tokenizer(model_dir):
    """The model's tokenizer, or a ValueError naming the directory (transformers' own error for a missing
    one speaks of sentencepiece and tiktoken)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, OSError, TypeError by case
        raise ValueError(f"the model {model_dir} has no tokenizer transformers can load (tokenizer.json or "
                         f"tokenizer_config.json with its vocabulary files): {str(e).strip().splitlines()[0]}") from e


def fit_model_length(config, model_dir, tasks, engine_options: dict) -> dict:
    """Refuse a prompt that cannot fit the model with its completion, naming it; and size the
    engine's sequences for the task's longest one (not the model's whole context) where known."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(model_dir).get_text_config(), "max_position_embeddings", None)
    limit = engine_options.get("max_model_len") or limit
    if limit and config.max_new_tokens >= limit:   # whatever the prompts (a prompt_fn's are known at step 1 only)
        raise ValueError(f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in the model's {limit} "
                         "positions")
    longest = 0
    for task in tasks:
        if task is None or task.longest_prompt() is None:
            continue
        for row, ids in enumerate(task.prompt_token_ids):
            if limit and len(ids) + config.max_new_tokens > limit:
                images = " (its images' tokens included)" if getattr(task, "image_column", None) else ""
                raise ValueError(f"{task.describe_row(row)}: prompt of {len(ids)} tokens{images} + max_new_tokens="
                                 f"{config.max_new_tokens} exceeds the model's {limit} positions "
                                 "(shorten it, set max_prompt_length with truncate_prompts='left', or lower "
                                 "max_new_tokens)")
        longest = max(longest, task.longest_prompt())
    # An environment's reset() may lengthen a prompt by what it returns: the engine keeps the model's limit.
    varying = any(getattr(task, "environment", None) is not None for task in tasks)
    if longest and "max_model_len" not in engine_options and not varying:
        engine_options["max_model_len"] = longest + config.max_new_tokens
    return engine_options


def longest_sequence(config, task: Task) -> int:
    """Prompt plus completion tokens of the longest sequence: the task's longest prompt where it
    knows it, else judged by the first step's prompts."""
    longest = task.longest_prompt()
    if longest is None:
        longest = max((len(p) for p in task.batch(1, config.prompts_per_step)[1]), default=1)
    return longest + config.max_new_tokens


def checked_prompts(config, prompts, step: int, vocab: int, max_model_len: int) -> list[list[int]]:
    """Token id lists the engine can take, or a ValueError naming the prompt and step."""
    count, new_tokens = config.prompts_per_step, config.max_new_tokens
    if not isinstance(prompts, (list, tuple)) or len(prompts) != count:
        raise ValueError(f"prompt_fn({step}, {count}) must return a list of {count} prompts, got "
                         f"{type(prompts).__name__} of {len(prompts) if hasattr(prompts, '__len__') else '?'}")
    checked = []
    for i, p in enumerate(prompts):
        p = p if isinstance(p, ImagePrompt) else [int(t) for t in p]
        if not p or min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {i} of step {step} must be a non-empty list of token ids in [0, {vocab})")
        if len(p) + new_tokens > max_model_len:
            raise ValueError(f"prompt {i} of step {step} has {len(p)} tokens; with max_new_tokens={new_tokens} "
                             f"it exceeds the engine's max_model_len {max_model_len}")
        checked.append(p)
    return checked


def rank_batch(task: Task, config, world, step: int, engine) -> tuple[list, list[list[int]], list[dict]]:
    """(rows, prompts, sampling options) of this data-parallel rank's share of step `step`'s prompts
    (uneven when the ranks do not divide them), every prompt checked against the engine's vocabulary
    and max_model_len first (a ValueError naming the prompt and step)."""
    rows, prompts = task.batch(step, config.prompts_per_step)
    prompts = checked_prompts(config, prompts, step, engine.vocab_size, engine.max_model_len)
    share = distributed.rank_share(config.prompts_per_step, world)
    return rows[share.start:share.stop], prompts[share.start:share.stop], sampling_options(config, task, step, share)


def stop_options(task: Task) -> dict:
    """SamplingParams' stop tokens for a task's completions (none: the engine's own rule)."""
    return dict(stop_token_ids=list(task.stop_token_ids)) if task.stop_token_ids else {}


def guided_options(config) -> dict:
    """SamplingParams' guided decoding for the run's regex (none without one): training and evaluation
    generate under the same grammar, as TRL's do."""
    return {"structured_outputs_regex": config.structured_outputs_regex} if config.structured_outputs_regex else {}


def sampling_options(config, task: Task, step: int, share: range) -> list[dict]:
    """Per-prompt sampling settings of a step's prompts `share`. Seeds depend on (run seed, step,
    prompt index) only, so a resumed run, or a run with a different number of ranks, draws the same
    completions."""
    per_step = config.prompts_per_step * config.num_generations
    top_k = dict(top_k=config.top_k) if config.top_k else {}
    extra = dict(config.generation_kwargs or {})
    if config.min_p is not None:
        extra["min_p"] = config.min_p
    if config.repetition_penalty != 1.0:
        extra["repetition_penalty"] = config.repetition_penalty
    stop = stop_options(task)
    # TRL suppresses the image token in generation: a sampled placeholder would not match the image features.
    banned = {"logit_bias": {t: -100.0 for t in task.placeholder_token_ids()}} if task.placeholder_token_ids() else {}
    return [dict(n=config.num_generations, max_tokens=config.max_new_tokens, temperature=config.temperature,
                 top_p=config.top_p, ignore_eos=config.ignore_eos, **stop, **top_k, **guided_options(config), **banned,
                 **extra,
                 seed=(config.seed * 1_000_003 * per_step + step * per_step
                       + i * config.num_generations) % (2**63 - 1),
                 logprobs=0)
            for i in share]
