"""The check at share time: the engine and the trainer compute the same function of the one copy.

The layout colo reads from vLLM's loader says where every weight is, exactly; it cannot say that vLLM
and transformers compute the same function of them. A family where they differ (a config field one of
them ignores, a norm or a scale implemented otherwise) would train a policy the engine does not sample
from, so share_weights compares the two before the first step.

Both round, and in bf16 the rounding alone moves a real model's log-probabilities by hundredths to
tenths of a nat; a fixed tolerance refuses real models or passes wrong ones. So the check measures what
rounding does to this model on this text, and compares the engine against the same weights computed in
fp32 (the trainer's model, each module cast up while it runs: `computed_in`):

    engine   = mean |log p_engine - log p_fp32|           over the probe's tokens
    rounding = mean |log p_16bit  - log p_fp32|           the trainer's model in the 16-bit dtype
    refused where engine > ROUNDING_FACTOR * rounding + ABSOLUTE_TOLERANCE

An engine that computes the same function rounds about as transformers does: `engine` came out at 0.4-1.3
times `rounding` (docs/families.md has the figures), while a different function (a rope_theta, an eps, an
embedding scale or a permuted weight) moves it far past it. In fp32, `rounding` is 0 and the bound is
ABSOLUTE_TOLERANCE (rounding there: about 1e-6).

The probe is text a model sees: its chat template over PROBE_MESSAGE (or the message as plain text)
with GREEDY_TOKENS tokens the engine continues it with, and token ids spread over the vocabulary
(`probe_ids`), where the log-probabilities are large and a different function shows most.

Equal values at share time do not prove that the engine will serve the next ones: a kernel may keep a
copy of a weight made at load (a packed layout) that colo does not know to refresh. So the check then
changes every trainer weight (negated: exact, and exactly undone), publishes, compares the same way, and
restores (check_engine_follows). Negation moves each weight most, so that even one stale layer shows.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from .errors import ColoError

logger = logging.getLogger(__name__)

PROBE_TOKENS = 32
PROBE_MESSAGE = "What is 17 + 25? Answer with a number, then say why in one sentence."
GREEDY_TOKENS = 16
ABSOLUTE_TOLERANCE = 1e-3   # the mean gap an fp32 engine may show (its rounding: about 1e-6)
ROUNDING_FACTOR = 3.0       # how many times the trainer's own rounding a 16-bit engine may be off


class EngineMismatch(ColoError, ValueError):
    """The engine does not compute what the trainer's model computes of the same weights, beyond what
    rounding makes (`gap`); at share time, or after a publish (`after_publish`). `message` says so; the
    exception's text adds `how_to_skip` (the library's switch; a command says its own flag instead)."""

    def __init__(self, message: str, gap: "LogprobGap", after_publish: bool = False,
                 how_to_skip: str | None = "share_weights(check_logprobs=False) trains anyway"):
        super().__init__(f"{message}; {how_to_skip}" if how_to_skip else message)
        self.message, self.gap, self.after_publish = message, gap, after_publish


@dataclass(frozen=True)
class LogprobGap:
    """How far the engine's log-probabilities of the probe are from the fp32 computation of the same
    weights (`engine`), beside how far rounding to `dtype` takes the trainer's model (`rounding`), and
    the engine's gap to the trainer itself (`direct`), each a mean over `tokens` tokens."""
    engine: float
    rounding: float
    direct: float
    tokens: int
    dtype: torch.dtype

    @property
    def tolerance(self) -> float:
        return ROUNDING_FACTOR * self.rounding + ABSOLUTE_TOLERANCE

    @property
    def within(self) -> bool:
        return self.engine <= self.tolerance   # (False for NaN)

    def summary(self) -> str:
        """The figures in a few words, for a run's first screen."""
        if self.rounding > 0:
            return f"{self.engine:.2g} from fp32, {self.engine / self.rounding:.2f}x {_name(self.dtype)}'s rounding"
        return f"{self.engine:.2g} from fp32"

    def describe(self) -> str:
        measured = f"the engine's log-probabilities are {self.engine:.3g} (mean over {self.tokens} tokens) from the " \
                   "same weights computed in fp32"
        if self.rounding > 0:
            return f"{measured}, {self.engine / self.rounding:.1f}x the {self.rounding:.3g} that rounding to " \
                   f"{_name(self.dtype)} makes of the trainer's model; at most {ROUNDING_FACTOR:g}x is rounding"
        return f"{measured}, beyond the {ABSOLUTE_TOLERANCE:g} rounding makes in fp32"


def probe_ids(vocab_size: int, count: int = PROBE_TOKENS, skip=()) -> list[int]:
    """Token ids spread over the vocabulary (the same ones every time), none of `skip` (a vision-language
    model's image placeholders, which stand for image features neither side is given here)."""
    ids = [(i * 7919 + 13) % vocab_size for i in range(count + len(skip))]
    return [t for t in ids if t not in set(skip)][:count]


def probe_sequences(hf_model, llm) -> list[list[int]]:
    """The probe: PROBE_MESSAGE as the model's tokenizer renders it (its chat template where it has one)
    continued by the engine's greedy tokens, where the model has a tokenizer; and probe_ids."""
    config = hf_model.config
    skip = {getattr(config, name) for name in ("image_token_id", "image_token_index")
            if isinstance(getattr(config, name, None), int)}
    longest = llm.llm_engine.model_config.max_model_len - 1   # and one generated token
    sequences = []
    message = _message_ids(llm)
    if message:
        message = message[:max(1, longest - GREEDY_TOKENS)]
        continued = _greedy(llm, message, min(GREEDY_TOKENS, longest - len(message)))
        sequences.append([t for t in message + continued if t not in skip][:longest])
    sequences.append(probe_ids(config.get_text_config().vocab_size, min(PROBE_TOKENS, longest), skip=skip))
    return [s for s in sequences if len(s) >= 2]


def _message_ids(llm) -> list[int]:
    """PROBE_MESSAGE in the model's tokenizer (chat template and all), or [] where it has none."""
    from . import vllm_compat as compat

    tokenizer = compat.engine_tokenizer(llm)
    if tokenizer is None:
        return []
    try:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": PROBE_MESSAGE}],
                                                add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
        else:
            ids = tokenizer(PROBE_MESSAGE)["input_ids"]
    except Exception as e:  # noqa: BLE001 - a template that does not render this message: the ids alone
        logger.info("share check: the tokenizer does not render the probe message (%s); probing ids only", e)
        return []
    return [int(t) for t in ids]


def _greedy(llm, ids: list[int], count: int) -> list[int]:
    from vllm import SamplingParams

    if count <= 0:
        return []
    with _kv_cache_awake(llm):
        output = llm.generate([{"prompt_token_ids": list(ids)}], SamplingParams(max_tokens=count, temperature=0.0),
                              use_tqdm=False)[0]
    return list(output.outputs[0].token_ids)


@contextlib.contextmanager
def _kv_cache_awake(llm):
    from .engine import KV_CACHE, engine_pool, sleep_kv_cache, wake_kv_cache

    pool = engine_pool(llm)   # None: an engine colo did not build (its KV cache never sleeps)
    asleep = pool is not None and KV_CACHE in pool.regions and pool.regions[KV_CACHE].asleep
    if asleep:
        wake_kv_cache(llm)
    try:
        yield
    finally:
        if asleep:
            sleep_kv_cache(llm)


def engine_logprobs(llm, sequences: list[list[int]]) -> torch.Tensor:
    """log p(s[i] | s[:i]) for i >= 1 of every sequence, as the engine computes them (one prefill each, no
    sampling), concatenated."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    with _kv_cache_awake(llm):
        outputs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
    return torch.tensor([entry[token].logprob for s, output in zip(sequences, outputs)
                         for token, entry in zip(s[1:], output.prompt_logprobs[1:])], dtype=torch.float64)


def trainer_logprobs(hf_model, sequences: list[list[int]], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same of the trainer's model, computed in `dtype` (computed_in; None: as the model is)."""
    device = next(hf_model.parameters()).device
    was_training = hf_model.training
    hf_model.eval()
    values = []
    try:
        with torch.no_grad(), computed_in(hf_model, dtype):
            for s in sequences:
                tokens = torch.tensor([s], device=device)
                logits = hf_model(input_ids=tokens).logits[0, :-1].double()
                values.append(torch.log_softmax(logits, -1)[torch.arange(len(s) - 1, device=device), tokens[0, 1:]])
    finally:
        hf_model.train(was_training)
    return torch.cat(values).cpu()


@contextlib.contextmanager
def computed_in(model: torch.nn.Module, dtype: torch.dtype | None):
    """Inside the block, `model`'s forward computes in `dtype` (None: as it is): each module's own
    floating parameters (and, cast up, its buffers) and the floating tensors it is given are cast while it
    runs, one module at a time, so no second copy of the whole model is made; everything is as it was after
    each module returns."""
    if dtype is None or all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        yield
        return
    up = dtype.itemsize >= 4   # cast up: buffers too (a bf16 model's fp32 buffers stay as they are cast down)
    held: list[list] = []

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def before(module, args, kwargs):
        kept = []
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                kept.append((p, p.data))
                p.data = p.data.to(dtype)
        for name, b in module._buffers.items():
            if up and b is not None and b.is_floating_point() and b.dtype != dtype:
                kept.append((name, b))
                module._buffers[name] = b.to(dtype)
        held.append(kept)
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def after(module, args, kwargs, output):
        for owner, value in held.pop():
            if isinstance(owner, str):
                module._buffers[owner] = value
            else:
                owner.data = value

    hooks = []
    for module in model.modules():
        if any(t is not None and t.is_floating_point()
               for t in (*module._parameters.values(), *module._buffers.values())):
            hooks.append(module.register_forward_pre_hook(before, with_kwargs=True))
            hooks.append(module.register_forward_hook(after, with_kwargs=True, always_call=True))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def measure_gap(hf_model, llm, sequences: list[list[int]]) -> LogprobGap:
    """The engine's and the trainer's log-probabilities of `sequences` against the fp32 computation of the
    trainer's weights, and the rounding of the lower-precision of the trainer's and the engine's dtypes."""
    from . import vllm_compat as compat

    return gap_to(engine_logprobs(llm, sequences), compat.engine_dtype(llm), hf_model, sequences)


def gap_to(engine: torch.Tensor, engine_dtype: torch.dtype, hf_model, sequences: list[list[int]]) -> LogprobGap:
    """measure_gap for log-probabilities `engine` of `sequences` that another implementation computed in
    `engine_dtype` (what colo.gpu_check measures of two of transformers' on a GPU, where vLLM is not)."""
    trainer_dtype = next(p.dtype for p in hf_model.parameters() if p.is_floating_point())
    trainer = trainer_logprobs(hf_model, sequences)
    reference = trainer_logprobs(hf_model, sequences, torch.float32)
    if trainer_dtype.itemsize < 4:
        rounded = trainer
    elif engine_dtype.itemsize < 4:
        rounded = trainer_logprobs(hf_model, sequences, engine_dtype)
    else:
        rounded = reference
    lowest = min(engine_dtype, trainer_dtype, key=lambda d: d.itemsize)
    return LogprobGap(engine=_mean_gap(engine, reference), rounding=_mean_gap(rounded, reference),
                      direct=_mean_gap(engine, trainer), tokens=len(engine), dtype=lowest)


def _mean_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """mean |a - b| over the tokens both give (an infinite log-probability on both sides agrees)."""
    both = torch.isfinite(a) & torch.isfinite(b)
    if not both.any():
        return math.nan
    return float((a[both] - b[both]).abs().mean())


def check_shared_logprobs(hf_model, llm, sequences: list[list[int]] | None = None) -> LogprobGap:
    """Raise EngineMismatch where the engine and the trainer compute different functions of the same
    weights (beyond rounding); returns the gap."""
    sequences = probe_sequences(hf_model, llm) if sequences is None else sequences
    gap = measure_gap(hf_model, llm, sequences)
    if not gap.within:
        raise EngineMismatch(
            f"the engine and the trainer's {type(hf_model).__name__} share every weight but compute different "
            f"functions of them: {gap.describe()} (vLLM and transformers implement this family differently, or a "
            "config field differs). Training would not be on-policy", gap)
    return gap


def check_engine_follows(shared, hf_model, llm, sequences: list[list[int]] | None = None) -> LogprobGap:
    """Raise EngineMismatch where the engine does not serve what the trainer computes after a publish: every
    trainer weight negated (exact, and exactly undone), published, both compared, negated back and
    published again. A tensor vLLM computed from the weights at load time and keeps (a kernel's private
    copy colo does not refresh) would keep serving the old values, which the check at share time alone
    cannot see (the values are still equal then). Returns the gap."""
    sequences = probe_sequences(hf_model, llm) if sequences is None else sequences
    parameters = [p for p in hf_model.parameters() if p.is_floating_point()]
    counted = shared.publish_count   # (the check's publishes are no user's)
    with torch.no_grad():
        for p in parameters:
            p.neg_()
    try:
        shared.publish()
        gap = measure_gap(hf_model, llm, sequences)
    finally:
        with torch.no_grad():
            for p in parameters:
                p.neg_()
        shared.publish()
        shared.publish_count = counted
    if not gap.within and math.isfinite(gap.rounding):
        raise EngineMismatch(
            f"after a publish the engine does not serve what the trainer's {type(hf_model).__name__} computes: with "
            f"every weight changed, {gap.describe()}: vLLM keeps a copy of some weight that colo does not refresh "
            "(a CPU kernel's packing colo does not know?). Training would not reach what the engine samples",
            gap, after_publish=True)
    return gap


def _name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
