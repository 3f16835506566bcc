"""GRPO on one device: generate with an in-process vLLM engine, train the same weights, repeat.

    from colo.grpo import GRPOScheduler, GRPOConfig
    run = GRPOScheduler(model_dir, config=GRPOConfig(num_generations=8), dataset="train.jsonl",
                        reward_funcs=["math", my_reward], out_dir="ckpt")
    run.run(steps=100)

A dataset has a `prompt` column (text or chat messages); reward functions have TRL's signature
(colo.grpo.task, colo.grpo.rewards). The token-level form, GRPOScheduler(model_dir, reward_fn,
prompt_fn, config), takes reward_fn(prompts, completions) -> one float per completion and
prompt_fn(step, count) -> prompts (lists of token ids). The command line is `python -m colo.grpo`
(see colo/grpo/cli.py).
"""
from .checkpoint import CheckpointError
from .config import GRPOConfig
from .loss import group_advantages, grpo_loss
from .rollout_engine import EngineFailure
from .toy_task import ToyTask, build_toy_model


def __getattr__(name):
    # The scheduler imports vLLM (slow); load it only when asked for.
    if name == "GRPOScheduler":
        from .scheduler import GRPOScheduler

        return GRPOScheduler
    raise AttributeError(name)


__all__ = ["GRPOScheduler", "GRPOConfig", "CheckpointError", "EngineFailure", "ToyTask", "build_toy_model",
           "group_advantages", "grpo_loss"]
