"""The scheduler's task set-up and per-step checks: the task built from what a user gave it, the
engine's sequence length fitted to the prompts, a step's prompts checked, its sampling settings."""
from __future__ import annotations

from .task import CallableTask, DatasetTask, Task


def build_tasks(config, model_dir, task, dataset, reward_funcs, reward_weights, eval_dataset, tokenizer, prompt_fn,
                reward_fn) -> tuple[Task, Task | None]:
    """The scheduler's training task (and eval one) from what it was given, checked before any engine starts."""
    given = [name for name, value in (("task", task), ("dataset", dataset), ("prompt_fn", prompt_fn))
             if value is not None]
    if len(given) != 1:
        raise ValueError("give the scheduler one of: dataset (with reward_funcs), prompt_fn (with reward_fn), "
                         f"or task; got {', '.join(given) or 'none'}")
    if eval_dataset is not None and dataset is None:
        raise ValueError("eval_dataset needs a dataset task (dataset and reward_funcs)")
    if config.eval_every and eval_dataset is None:
        raise ValueError(f"eval_every={config.eval_every} needs an eval_dataset")
    if task is not None:
        return task, None
    if prompt_fn is not None:
        if reward_fn is None:
            raise ValueError("prompt_fn needs a reward_fn")
        return CallableTask(prompt_fn, reward_fn), None
    if reward_funcs is None:
        raise ValueError("a dataset needs reward_funcs (TRL's reward functions, or names: colo.grpo.rewards)")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    options = dict(seed=config.seed, chat_template_kwargs=config.chat_template_kwargs,
                   max_prompt_length=config.max_prompt_length, truncate=config.truncate_prompts)
    train = DatasetTask(dataset, tokenizer, reward_funcs, reward_weights, name="dataset", **options)
    evaluation = None
    if eval_dataset is not None:
        evaluation = DatasetTask(eval_dataset, tokenizer, train.reward_funcs, train.weights.tolist(),
                                 name="eval dataset", **options)
    return train, evaluation


def fit_model_length(config, model_dir, tasks, engine_options: dict) -> dict:
    """Refuse a prompt that cannot fit the model with its completion, naming it; and size the
    engine's sequences for the task's longest one (not the model's whole context) where known."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)
    limit = engine_options.get("max_model_len") or limit
    longest = 0
    for task in tasks:
        if task is None or task.longest_prompt() is None:
            continue
        for row, ids in enumerate(task.prompt_token_ids):
            if limit and len(ids) + config.max_new_tokens > limit:
                raise ValueError(f"{task.describe_row(row)}: prompt of {len(ids)} tokens + max_new_tokens="
                                 f"{config.max_new_tokens} exceeds the model's {limit} positions "
                                 "(shorten it, set max_prompt_length with truncate_prompts='left', or lower "
                                 "max_new_tokens)")
        longest = max(longest, task.longest_prompt())
    if longest and "max_model_len" not in engine_options:
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
        p = [int(t) for t in p]
        if not p or min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {i} of step {step} must be a non-empty list of token ids in [0, {vocab})")
        if len(p) + new_tokens > max_model_len:
            raise ValueError(f"prompt {i} of step {step} has {len(p)} tokens; with max_new_tokens={new_tokens} "
                             f"it exceeds the engine's max_model_len {max_model_len}")
        checked.append(p)
    return checked


def stop_options(task: Task) -> dict:
    """SamplingParams' stop tokens for a task's completions (none: the engine's own rule)."""
    return dict(stop_token_ids=list(task.stop_token_ids)) if task.stop_token_ids else {}


def sampling_options(config, task: Task, step: int, share: range) -> list[dict]:
    """Per-prompt sampling settings of a step's prompts `share`. Seeds depend on (run seed, step,
    prompt index) only, so a resumed run, or a run with a different number of ranks, draws the same
    completions."""
    per_step = config.prompts_per_step * config.num_generations
    top_k = dict(top_k=config.top_k) if config.top_k else {}
    stop = stop_options(task)
    return [dict(n=config.num_generations, max_tokens=config.max_new_tokens, temperature=config.temperature,
                 top_p=config.top_p, ignore_eos=config.ignore_eos, **stop, **top_k,
                 seed=(config.seed * 1_000_003 * per_step + step * per_step
                       + i * config.num_generations) % (2**63 - 1),
                 logprobs=0)
            for i in share]
