"""A reward model as a reward function: a one-label sequence classifier (a tiny random Llama with
SmolLM2's tokenizer and chat template) scores prompt + completion as TRL takes it (the logit), from
weights that sleep in a pool region between scorings; what is not a reward model is refused."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, smollm2_model_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("rm") / "judge"
    LlamaForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_reward_model_scores_from_weights_asleep_in_the_pool(reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from colo import Pool
    from colo.grpo.reward_model import attach_reward_models
    from colo.grpo.rewards import load_reward, reward_name

    judge = load_reward(f"model:{reward_model_dir}")
    assert reward_name(judge) == "judge"   # the record's rewards/judge
    prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 3
    completions = [[{"role": "assistant", "content": text}] for text in ("4", "five", "It is 4, of course.")]
    before = judge(prompts=prompts, completions=completions)

    # TRL's rule by hand: the chat template over prompt + completion, the logit of each (one at a time).
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    for score, prompt, completion in zip(before, prompts, completions):
        text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            assert score == pytest.approx(float(model(**ids).logits[0, 0]), abs=1e-5)
    assert len(set(before)) == 3

    pool = Pool("cpu")
    assert attach_reward_models([judge, len], pool) == ["reward_model"]
    region = pool.regions["reward_model"]
    assert region.asleep and all(region.contains(p) for p in judge.model.parameters())
    assert judge(prompts=prompts, completions=completions) == pytest.approx(before, abs=1e-6)
    assert region.asleep   # asleep again once scored


def test_what_is_not_a_reward_model_is_refused(smollm2_model_dir, tmp_path):
    from colo.grpo.rewards import load_reward

    with pytest.raises(ValueError, match="is not a sequence classifier"):
        load_reward(f"model:{smollm2_model_dir}")
