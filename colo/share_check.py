"""The check at share time: the engine and the trainer compute the same log-probabilities.

The layout colo reads from vLLM's loader says where every weight is, exactly; it cannot say that vLLM
and transformers compute the same function of them. A family where they differ (a config field one of
them ignores, a norm or a scale implemented otherwise) would train a policy the engine does not sample
from, so share_weights compares the two on a few tokens before the first step:

    gap = mean |log p_engine(token | prefix) - log p_trainer(token | prefix)|   over PROBE_TOKENS tokens

and refuses a gap beyond what the dtype's rounding makes. Seen on tiny random models of the families
tests/sharing/test_families.py builds: about 5e-7 in float32, 1e-2 in bfloat16; a difference of function
is of the order of the logits' own spread (tenths and more).

Equal values at share time do not prove that the engine will serve the next ones: a kernel may keep a
copy of a weight made at load (a packed layout) that colo does not know to refresh. So the check then
changes every trainer weight (negated: exact, and exactly undone), publishes, compares again, and
restores (check_engine_follows).
"""
from __future__ import annotations

import torch

PROBE_TOKENS = 32
# The largest mean gap taken for rounding, by the engine's dtype.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


def probe_ids(vocab_size: int, count: int = PROBE_TOKENS, skip=()) -> list[int]:
    """Token ids spread over the vocabulary (the same ones every time), none of `skip` (a vision-language
    model's image placeholders, which stand for image features neither side is given here)."""
    ids = [(i * 7919 + 13) % vocab_size for i in range(count + len(skip))]
    return [t for t in ids if t not in set(skip)][:count]


def engine_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, as the engine computes them (one prefill, no sampling)."""
    from vllm import SamplingParams

    from .engine import KV_CACHE, engine_pool, sleep_kv_cache, wake_kv_cache

    pool = engine_pool(llm)   # None: an engine colo did not build (its KV cache never sleeps)
    asleep = pool is not None and KV_CACHE in pool.regions and pool.regions[KV_CACHE].asleep
    if asleep:
        wake_kv_cache(llm)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        output = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
    finally:
        if asleep:
            sleep_kv_cache(llm)
    return torch.tensor([entry[token].logprob for token, entry in zip(ids[1:], output.prompt_logprobs[1:])],
                        dtype=torch.float64)


def trainer_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    device = next(hf_model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    was_training = hf_model.training
    hf_model.eval()
    try:
        with torch.no_grad():
            logits = hf_model(input_ids=tokens).logits[0, :-1].double()
    finally:
        hf_model.train(was_training)
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1, device=device), tokens[0, 1:]].cpu()


def logprob_gap(hf_model, llm, ids: list[int] | None = None) -> float:
    """The mean absolute gap between the engine's and the trainer's log-probabilities of `ids`."""
    ids = _probe_ids_of(hf_model, llm) if ids is None else ids
    return float((engine_logprobs(llm, ids) - trainer_logprobs(hf_model, ids)).abs().mean())


def _probe_ids_of(hf_model, llm) -> list[int]:
    config = hf_model.config
    placeholders = [getattr(config, name) for name in ("image_token_id", "image_token_index")
                    if isinstance(getattr(config, name, None), int)]
    count = min(PROBE_TOKENS, llm.llm_engine.model_config.max_model_len - 1)  # and one generated token
    return probe_ids(config.get_text_config().vocab_size, count, skip=placeholders)


def check_engine_follows(shared, hf_model, llm) -> float:
    """Raise ValueError where the engine does not serve what the trainer computes after a publish: every
    trainer weight negated (exact, and exactly undone), published, both compared, negated back and
    published again. A tensor vLLM computed from the weights at load time and keeps (a kernel's private
    copy colo does not refresh) would keep serving the old values, which the check at share time alone
    cannot see (the values are still equal then). Returns the gap."""
    parameters = [p for p in hf_model.parameters() if p.is_floating_point()]
    counted = shared.publish_count   # (the check's publishes are no user's)
    with torch.no_grad():
        for p in parameters:
            p.neg_()
    try:
        shared.publish()
        ids = _probe_ids_of(hf_model, llm)
        trainer = trainer_logprobs(hf_model, ids)
        gap = float((engine_logprobs(llm, ids) - trainer).abs().mean())
    finally:
        with torch.no_grad():
            for p in parameters:
                p.neg_()
        shared.publish()
        shared.publish_count = counted
    tolerance = _tolerance(llm)
    if torch.isfinite(trainer).all() and not gap <= tolerance:
        raise ValueError(
            f"after a publish the engine does not serve what the trainer's {type(hf_model).__name__} computes: mean "
            f"gap {gap:.3g} over up to {PROBE_TOKENS - 1} tokens with every weight changed, beyond {tolerance:g}: vLLM "
            "keeps a copy of some weight that colo does not refresh (a CPU kernel's packing colo does not know?). "
            "Training would not reach what the engine samples; share_weights(check_logprobs=False) skips this check")
    return gap


def check_shared_logprobs(hf_model, llm) -> float:
    """Raise ValueError where the engine and the trainer disagree beyond rounding; returns the gap."""
    from . import vllm_compat as compat

    gap = logprob_gap(hf_model, llm)
    tolerance = _tolerance(llm)
    if not gap <= tolerance:
        raise ValueError(
            f"the engine and the trainer's {type(hf_model).__name__} share every weight but compute different "
            f"log-probabilities: mean gap {gap:.3g} over up to {PROBE_TOKENS - 1} tokens, beyond {tolerance:g} for "
            f"{compat.engine_dtype(llm)} (vLLM and transformers implement this family differently, or a config field "
            "differs). Training would not be on-policy; share_weights(check_logprobs=False) skips this check")
    return gap


def _tolerance(llm) -> float:
    """The largest mean gap taken for rounding in the engine's dtype."""
    from . import vllm_compat as compat

    return TOLERANCE.get(compat.engine_dtype(llm), 0.1)
