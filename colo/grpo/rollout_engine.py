"""The scheduler's view of the engine: build it in the pool, share the trainer's weights with it,
generate whole rollout batches, publish updates, and rebuild it from the shared weights if it breaks.

The building blocks are colo.engine (an in-process vLLM whose KV cache lives in the pool's kv_cache
region) and colo.weights (one copy of the weights for trainer and engine); this file only decides
how big the KV cache is and turns vLLM's outputs into plain token lists.
"""
from __future__ import annotations

import gc
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from .. import engine as colo_engine
from .. import vllm_compat as compat
from .images import ImagePrompt
from ..errors import EngineFailure, OutOfMemoryError  # noqa: F401 - EngineFailure raised here, re-exported
from ..kv_sizing import default_block_size, kv_bytes_per_token, kv_cache_blocks, parameter_bytes  # noqa: F401
from ..lora import LoraSpec, share_adapter, slot_bytes
from ..model_classes import is_vision_language, trainer_auto_class
from ..shared import PublishReport  # noqa: F401 - publish()'s type
from ..regions import KV_CACHE
from ..weights import share_weights, shared_model

logger = logging.getLogger(__name__)

_KV_HEADROOM = 64 << 20  # room left in the pool for allocator rounding and small engine buffers


def engine_input(prompt) -> dict:
    """What vLLM is given for a prompt: its token ids, or a vision-language prompt's text and images
    (colo.grpo.images.ImagePrompt), which vLLM's processor expands into the same ids."""
    return prompt.engine_input if isinstance(prompt, ImagePrompt) else {"prompt_token_ids": prompt}


def check_expanded_prompt(prompt, engine_ids, index: int) -> None:
    """The engine's prompt is the trainer's: a vision-language prompt's image placeholders expanded by
    vLLM's processor as by transformers' (they differ, e.g., in image sizes: refused, never trained on)."""
    if isinstance(prompt, ImagePrompt) and list(engine_ids) != list(prompt):
        raise ValueError(f"prompt {index}: vLLM's processor made {len(engine_ids)} prompt tokens of the text and "
                         f"images, transformers' processor {len(prompt)}; the trainer would not see what the "
                         "engine generated from (check the processor's settings in the model directory)")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float] | None  # the engine's log-probability of each sampled token (raw logits)
    truncated: bool = False       # stopped by max_tokens rather than by EOS or a stop token
    # A MoE engine's experts for each position the engine ran, prompt and completion but its last token:
    # [positions, MoE layers, top_k] int16 (colo.vllm_compat.routing), else None.
    routes: torch.Tensor | None = None


class GenerationTrace:
    """Running sequences over one generation: the tail is the time with fewer than a quarter of the
    batch's sequences still decoding (the engine mostly idle while a few long completions finish);
    step_seconds: each engine step's wall time (what decoding one token of every running sequence
    takes: the latency a trainer working beside the engine may stretch)."""

    def __init__(self):
        self.started = self.tail_started = self._last = None
        self.sequences = 0
        self.tail_s = 0.0
        self.step_seconds: list[float] = []

    def start(self, sequences: int) -> None:
        self.started = self._last = time.perf_counter()
        self.sequences = sequences

    def sample(self, running: int) -> None:
        now = time.perf_counter()
        self.step_seconds.append(now - self._last)
        self._last = now
        if self.tail_started is None and running < self.sequences / 4:
            self.tail_started = now
        if self.tail_started is not None:
            self.tail_s = now - self.tail_started

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else 0.0


class RolloutEngine:
    """An in-process vLLM engine built in the pool, and the trainer's model, which shares its weights.

    The engine is built first (its weights land in the pool's `weights` region as vLLM loads them);
    `hf_model` is then a Hugging Face model whose parameters are views of those tensors (nothing is
    loaded twice, nothing copied at hand-off).
    dtype: the dtype of the engine and of the trainer's parameters.
    sequence_tokens: the longest prompt plus the completion length. The KV cache holds max_num_seqs
    such sequences at once (the whole rollout batch, so it runs as one continuously batched call,
    never preempted), checked against what the pool has left, never a user-tuned memory fraction.
    alias=False: the trainer loads its own copy of the weights from disk, in `trainer_dtype` (default:
    `dtype`), and publish() copies them into the engine (colo.share_weights' copy path; the usual
    way, for comparisons).
    lora: a colo.lora.LoraSpec: the base is frozen and shared as above, and `adapter` (colo.lora) is
    the trainable adapter, a view of the engine's adapter slot; every generation uses it and
    publish() copies nothing. `workdir` holds the zero adapter the engine loads once at start.
    tensor_parallel: ranks of the engine (under torchrun, consecutive ranks): `shared` is then this
    rank's colo.tensor_parallel.TensorParallelModel, `hf_model` its module (this rank's shards, views
    of the engine's), and publish() copies nothing.
    `views` is what the trainer trains (colo.shared's contract, whichever kind it is).
    """

    def __init__(self, model_dir, pool, *, seed: int, max_num_seqs: int, sequence_tokens: int = 1,
                 max_model_len: int | None = None, dtype: torch.dtype = torch.float32, alias: bool = True,
                 trainer_dtype: torch.dtype | None = None, lora: LoraSpec | None = None, workdir=None,
                 tensor_parallel: int = 1, share_check: bool = True, **llm_kwargs):
        from transformers import AutoConfig

        self.model_dir, self.pool, self.seed, self.alias, self.dtype = model_dir, pool, seed, alias, dtype
        self.share_check = share_check
        if alias and trainer_dtype not in (None, dtype):
            raise ValueError("a trainer that shares the engine's weights has the engine's dtype; trainer_dtype "
                             "needs alias=False")
        self.trainer_dtype = trainer_dtype or dtype
        if lora is not None:
            if not alias:
                raise ValueError("a LoRA adapter is trained on the engine's own base weights; lora needs alias=True")
            if workdir is None:
                raise ValueError("lora needs a workdir for the adapter the engine loads at start")
            llm_kwargs.update(lora.engine_options())
        if tensor_parallel > 1:
            if not alias:
                raise NotImplementedError("tensor parallelism shares the engine's shards with the trainer: it does not "
                                          "take alias=False yet")
            if lora is not None:
                compat.check_shareable_lora(bool(llm_kwargs.get("fully_sharded_loras")), tensor_parallel)
            llm_kwargs["tensor_parallel_size"] = tensor_parallel
        self.tp_size = tensor_parallel
        config = AutoConfig.from_pretrained(model_dir)
        text = config.get_text_config()  # a vision-language model's language model (else the config itself)
        self.vocab_size = text.vocab_size
        self.max_model_len = max_model_len or getattr(text, "max_position_embeddings", 2048)
        # vLLM hands out KV memory in whole blocks per sequence: a 24-token sequence takes a full
        # 128-token block on CPU. Sized by tokens alone, a batch of short sequences is short of blocks
        # and generation crawls through preemptions.
        block = llm_kwargs.pop("block_size", None) or default_block_size(pool.device)
        self.block_size = block  # tokens per KV block (vLLM's prefix cache reuses whole blocks)
        # vLLM makes bytes // (block x the layers' page bytes) blocks (v1/core/kv_cache_utils.py,
        # get_kv_cache_config_from_groups); a full-attention page is block x one layer's K and V per
        # token, so these bytes give exactly `blocks`, null block included.
        blocks = max(kv_cache_blocks(max_num_seqs, sequence_tokens, block), kv_cache_blocks(1, self.max_model_len, block))
        self.adapter_slot_bytes = slot_bytes(config, lora, dtype, tensor_parallel) if lora else 0
        # Model Runner V2 (a GPU's default) allocates its sampler's max_num_seqs x vocab buffers in
        # load_model, so in the weights region: not parameters, and not in the KV cache's budget.
        self.runner_buffer_bytes = compat.sampler_buffer_bytes(text.vocab_size, max_num_seqs, pool.device.type)
        self.kv_cache_bytes = self._kv_budget(blocks * block * kv_bytes_per_token(config, dtype, tensor_parallel), config)
        # Token ids in and out; guided decoding needs the tokenizer, and so does a vision-language model's
        # processor, which expands the images of a prompt given as text (colo.grpo.images).
        llm_kwargs.setdefault("skip_tokenizer_init", not is_vision_language(config))
        # Every request is seeded (sampling_options): on a CPU none may be prefilled in pieces.
        for key, value in compat.whole_prefill_options(pool.device.type, max_num_seqs, sequence_tokens).items():
            llm_kwargs.setdefault(key, value)
        self._llm_kwargs = dict(max_num_seqs=max_num_seqs, block_size=block, **llm_kwargs)
        self.llm = self._build(load_format="auto")
        self.shared = self._share()
        self.hf_model = self.shared.hf_model
        self.adapter = share_adapter(self.hf_model, self.llm, lora, workdir, seed=seed,
                                     tp=self.shared if tensor_parallel > 1 else None) if lora else None

    def describe(self) -> str:
        """One line for a run's first screen: the engine, and what the trainer holds of it."""
        kernels = colo_engine.cpu_kernels(self.llm)
        engine = (f"vLLM {compat.import_vllm().__version__} on {self.pool.device.type}, "
                  f"{'compiled' if compat.is_compiled(self.llm) else 'eager'}"
                  + (f" ({', '.join(f'{n} {k}' for k, n in sorted(kernels.items()))} linears)" if kernels else ""))
        copied = self.views.copy_bytes
        held = "the trainer's weights are views of its tensors (0 bytes copied per publish)" if not copied else \
            f"each publish copies {copied} bytes of the trainer's into it (the copy path)"
        checked = self.shared.logprob_checks
        if checked:
            check = f"log-probabilities {checked['at_share'].summary()} (after a publish: " \
                    f"{checked['after_publish'].summary()})"
        else:
            check = "log-probabilities not compared (--no-share-check)" if not self.share_check else \
                "log-probabilities not compared for this kind of views"
        return f"engine: {engine}; {held}; {check}"

    @property
    def views(self):
        """What the trainer trains, a colo.shared.EngineViews: the adapter with LoRA, else the weights
        (whole, or this rank's tensor-parallel shards)."""
        return self.adapter or self.shared

    def _kv_budget(self, wanted: int, config) -> int:
        if KV_CACHE in self.pool.regions:
            return self.pool.regions[KV_CACHE].budget
        # The weights are not loaded yet: leave room for them. Regions asleep now (the training
        # memory, while generating) do not count.
        weights = parameter_bytes(config, self.dtype) // self.tp_size  # a rank's shards (norms whole: small)
        left = self.pool.unbudgeted_bytes - weights - self.adapter_slot_bytes - self.runner_buffer_bytes - _KV_HEADROOM
        if left < wanted:
            raise OutOfMemoryError(f"the KV cache needs {wanted} bytes for the rollout batch but the pool has "
                                   f"only {max(left, 0)} left after the weights, the model runner's buffers "
                                   f"({self.runner_buffer_bytes} bytes) and the regions awake during generation "
                                   f"({self.pool.capacity}-byte capacity)")
        return wanted

    def _build(self, load_format: str):
        return colo_engine.build_llm(self.model_dir, self.pool, dtype=self.dtype, seed=self.seed,
                                     kv_cache_bytes=self.kv_cache_bytes, max_model_len=self.max_model_len,
                                     load_format=load_format, **self._llm_kwargs)

    def _share(self, hf_model=None):
        if hf_model is not None:
            return share_weights(hf_model, self.llm, alias=self.alias, check_logprobs=self.share_check)
        if self.tp_size > 1:
            from ..tensor_parallel import shared_tp_model

            return shared_tp_model(self.llm)
        if self.alias:
            return shared_model(self.llm, self.dtype, check_logprobs=self.share_check)
        from transformers import AutoConfig

        with compat.building_trainer_models():
            auto = trainer_auto_class(AutoConfig.from_pretrained(self.model_dir))
            own = auto.from_pretrained(self.model_dir, dtype=self.trainer_dtype)
        own = own.to(self.pool.device).train()
        return share_weights(own, self.llm, alias=False, check_logprobs=self.share_check)

    @property
    def kv_region(self):
        return colo_engine.kv_cache_region(self.llm)

    @property
    def kv_cache_asleep(self) -> bool:
        return self.kv_region.asleep

    def sleep_kv_cache(self) -> None:
        """Release the KV cache's memory (training does not need it); generation refuses until woken."""
        colo_engine.sleep_kv_cache(self.llm)

    def wake_kv_cache(self) -> None:
        """Bring the KV cache back before generating; prefixes it no longer holds are forgotten."""
        colo_engine.wake_kv_cache(self.llm)

    def generate(self, prompts: list[list[int]], sampling: list[dict], on_group=None,
                 trace: "GenerationTrace | None" = None) -> list[Completion]:
        """All prompts in one engine call; returns n completions per prompt, prompt after prompt.

        on_group(i, completions): called (on this thread, between engine steps) as soon as every
        completion of prompt i has finished, while the engine goes on decoding the others.
        trace: records how many sequences were running after each engine step (GenerationTrace)."""
        with compat.recording_routes(self.llm):   # a MoE engine's experts, read with each finished output
            return self._generate(prompts, sampling, on_group, trace)

    def _generate(self, prompts, sampling, on_group, trace) -> list[Completion]:
        internal = self._enqueue(prompts, sampling)
        ids = [compat.external_request_id(request_id) for request_id in internal]
        index = {request_id: i for i, request_id in enumerate(ids)}
        groups: list[list[Completion] | None] = [None] * len(prompts)
        if trace is not None:
            trace.start(self.unfinished())
        try:
            while self.unfinished():
                for out in self.step():
                    i = index[out.request_id]
                    check_expanded_prompt(prompts[i], out.prompt_token_ids, i)
                    groups[i] = self._completions(out, sampling[i]["n"], internal[i])
                    if on_group is not None:
                        on_group(i, groups[i])
                if trace is not None:
                    trace.sample(self.unfinished())
        except BaseException:
            # Requests left behind would come out of the next generation's steps.
            self.abort([ids[i] for i, group in enumerate(groups) if group is None])
            raise
        missing = [i for i, g in enumerate(groups) if g is None]
        if missing:
            raise RuntimeError(f"engine finished without the completions of prompts {missing[:5]}")
        return [c for group in groups for c in group]

    # -- requests one at a time (colo.grpo.agent drives the engine turn by turn with these) --------
    def enqueue(self, prompts: list[list[int]], sampling: list[dict]) -> list[str]:
        """Queue one request per prompt (SamplingParams' fields in `sampling`); their ids, as step() names them."""
        return [compat.external_request_id(request_id) for request_id in self._enqueue(prompts, sampling)]

    def _enqueue(self, prompts: list[list[int]], sampling: list[dict]) -> list[str]:
        """enqueue(), returning the engine's own ids of the requests."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        params = []
        for options in sampling:
            options = dict(options)
            regex = options.pop("structured_outputs_regex", None)
            if regex is not None:
                options["structured_outputs"] = StructuredOutputsParams(regex=regex)
            params.append(SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **options))
        # LLM.generate is enqueue + a loop of engine steps (vllm/entrypoints/common/offline.py,
        # _run_engine); running that loop here sees each request the step it finishes.
        return self.llm.enqueue([engine_input(p) for p in prompts], params, use_tqdm=False,
                                lora_request=self.adapter.request if self.adapter else None)

    def step(self) -> list:
        """One engine step; the requests it finished (vLLM RequestOutputs: request_id, outputs,
        prompt_token_ids, num_cached_tokens: the prompt tokens the prefix cache served)."""
        return [out for out in self.llm.llm_engine.step() if out.finished]

    def unfinished(self) -> int:
        return self.llm.llm_engine.get_num_unfinished_requests()

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.llm.llm_engine.abort_request(list(request_ids))  # external ids (enqueue gives those)

    def _completions(self, out, n: int, internal_id: str) -> list[Completion]:
        if len(out.outputs) != n:
            raise RuntimeError(f"engine returned {len(out.outputs)} completions for a prompt, expected {n}")
        routes = compat.routed_experts(self.llm, out, internal_id)
        completions = []
        for c, route in zip(sorted(out.outputs, key=lambda c: c.index), routes):
            ids = list(c.token_ids)
            logprobs = [step[t].logprob for step, t in zip(c.logprobs, ids)] if c.logprobs else None
            completions.append(Completion(ids, logprobs, truncated=c.finish_reason == "length", routes=route))
        return completions

    def publish(self) -> "PublishReport":
        return self.views.publish()

    def rebuild(self) -> None:
        """Replace a broken engine by a fresh one serving the trainer's weights (nothing read from disk)."""
        if self.tp_size > 1:  # the other ranks' engine shards would have to be rebuilt in step with this one
            raise EngineFailure("a tensor-parallel engine is not rebuilt after a failure; resume from the last "
                                "checkpoint")
        region = self.kv_region
        # The trainer's parameters are views of the old engine's tensors: they take private copies of their
        # values for the moment, so the old tensors die with the old engine and the new one can take their
        # place in the weights region; rebind() then writes the values into the new engine's tensors.
        self.views.detach()
        colo_engine.release_llm(self.llm)
        self.llm = None
        gc.collect()  # the old engine's KV cache returns to the region before the new one asks for it
        if region.stats()["allocated_bytes"]:
            raise EngineFailure("the broken engine could not be freed (its KV cache is still allocated), "
                                "so no new engine fits in the kv_cache region")
        if region.asleep:
            region.wake()
        # "dummy" fills the new engine with placeholder weights instead of reading the checkpoint.
        self.llm = self._build(load_format="dummy")
        self.views.rebind(self.llm)  # the same parameters (the optimizer's), now the new engine's tensors

    def close(self) -> None:
        if self.llm is not None:
            colo_engine.release_llm(self.llm)
        self.llm = self.shared = self.hf_model = self.adapter = None
        gc.collect()


def engine_error(error: BaseException, step: int) -> str:
    """What a failed generation's error says, where rebuilding the engine may help. A request vLLM refused
    is the run's settings, not the engine: ValueError, naming them (no rebuild would help)."""
    if isinstance(error, compat.request_errors()):
        raise ValueError(f"step {step}: vLLM refused the run's requests: {error} (check the sampling settings: "
                         "temperature, top_p, top_k, max_new_tokens, structured_outputs_regex)") from error
    return f"{type(error).__name__}: {error}"


def rebuild_engine(engine: RolloutEngine, failure: str, *, step: int, rank: int, timeline) -> float:
    """Rebuild `engine` from the shared weights after it raised (`failure`, engine_error's); the seconds
    it took. EngineFailure where it cannot be rebuilt."""
    logger.warning("rank %d step %d: engine raised %s; rebuilding it from the shared weights and retrying once",
                   rank, step, failure)
    with timeline.span("engine_rebuild", step=step) as span:
        try:
            engine.rebuild()
        except Exception as e:  # noqa: BLE001 - reported as an EngineFailure, which ranks share
            raise EngineFailure(f"step {step}: the engine raised {failure} and could not be rebuilt from the "
                                f"shared weights: {type(e).__name__}: {e}") from e
    return span["seconds"]
