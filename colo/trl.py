"""colo as the colocate backend of TRL's GRPOTrainer, RLOOTrainer and DistillationTrainer: one copy of
the weights, 0 bytes per sync.

    from colo.trl import GRPOTrainer           # instead of: from trl import GRPOTrainer
    trainer = GRPOTrainer(model=model_dir_or_model, reward_funcs=reward, train_dataset=dataset,
                          args=trl.GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
    trainer.train()

RLOOTrainer (with trl.RLOOConfig) and DistillationTrainer (trl.DistillationConfig; its frozen teacher
is TRL's, beside the engine) get everything below but the log-probability pass, routing replay and
vision-language models, which are GRPOTrainer's.

What changes (everything else is TRL's: rewards, datasets, logging, callbacks, checkpoints):
- the engine is built by colo.engine.build_llm: its weights in the pool's `weights` region, its KV
  cache in `kv_cache`, vLLM's default (compiled) mode, the same vLLM arguments TRL passes. vLLM
  reads no checkpoint: the trainer's weights are written into it once;
- its dtype is the one that makes the whole step fastest on the device (colo.dtype_choice): an fp32
  model (TRL's default) on a device that computes bf16 faster than fp32 (CUDA since Ampere, CPUs with
  AMX, those with AVX512_BF16 where a bf16 matmul times faster) gets a bf16 engine, the trainer's
  parameters become those bf16 tensors and TRL's optimizer steps fp32 masters of them (the model's
  own fp32 values: colo.optimizer_masters), which its checkpoints and `save_model` save; elsewhere, or with `bf16=False`, an explicit
  `model_init_kwargs={"dtype": ...}`, a 16-bit model or `cast_lm_head_to_fp32`, the trainer's
  dtype. `colo_engine_dtype=` decides instead (bf16 for an fp32 model: the masters as above);
- the trainer's parameters become views of the engine's tensors (colo.share_weights), so TRL's
  `sync_weights` is `publish()`: no `load_weights` call, 0 bytes copied (on a CPU, vLLM's packed
  kernel copies are refreshed in place) and the prefix cache reset TRL does;
- TRL's optimizer skips a step whose gradients hold an inf or a NaN (colo.clipping.NonFiniteStepGuard),
  since the weights it steps are the ones the engine serves; TRL's metrics get `colo/skipped_steps`,
  the count so far;
- where TRL's steps are aligned (its default), its vLLM importance-sampling ratio and `sampling/*`
  metrics come from the training forward's log-probabilities, not from a no-grad pass of their own
  (colo.trl_importance): one log-probability pass a step instead of two;
- the KV cache sleeps (memory released) from the end of each generation until the next one; a
  request that reaches the engine outside TRL's generation (a user's `llm.generate`, an eval
  callback) wakes it, and it sleeps again when TRL next computes a loss;
- parameters given new storage after sharing (accelerate's prepare() under torch.distributed on a
  CPU moves the model to "cpu:N", which torch copies) are shared again at the next sync, one copy,
  reported as `reshared_bytes` in `colo_sync_reports`.

A PEFT LoRA model (`peft_config=LoraConfig(...)`, or a PeftModel): the base is shared as above,
frozen, in the engine's dtype; the engine serves the adapter from its own LoRA slot (vLLM's
`enable_lora`, one slot, the smallest slot rank >= r) and PEFT's lora_A / lora_B become views of that
slot (colo.lora.share_peft_adapter: the slot holds PEFT's scaling x B, the layer's scaling becomes
1 and B's gradient is scaled back, so clipping sees PEFT's gradients). Every request the engine gets
is served base + adapter. TRL's optimizer steps fp32 masters of the adapter in PEFT's units, which
checkpoints and `save_model` save in PEFT's format. A sync is the adapter's publish(): 0 bytes, no
merge, no load_weights, no adapter reload. Supported: LoRA (rslora, dropout, any init) on the linear
layers of the base, one adapter (and TRL's frozen "ref" copy for beta > 0 with a pretrained one).
On a vision-language model the adapter is the language model's (vLLM has adapter slots there only; an
adapter of a tower or projector layer is refused, its message giving a target_modules that keeps the
language model's). Refused with a NotImplementedError before the engine starts: DoRA, bias, lora_bias,
modules_to_save, rank/alpha patterns, trainable tokens, layers_to_transform, targets other than
nn.Linear (embeddings, Conv1D, quantized layers, target_parameters), several adapters, tensor
parallelism. On a CPU, vLLM
runs a LoRA engine eager (its CPU platform turns compilation off when LoRA is enabled); colo gives its
punica wrapper a one-adapter fast path (colo.vllm_compat), without which LoRA doubled a generate.

A vision-language model trains through TRL's image columns and processor; the engine gets each image
prompt as the chat template wrote it and expands its images itself (colo.trl_vision: TRL's own path
sends the processor's expanded ids, which vLLM expands again).

The copy path is used, and reported by `trainer.colo_shared`, where a parameter cannot alias: an
fp32 engine for a 16-bit trainer (`colo_engine_dtype=`), or tensor-parallel shards. Supported:
one process or DDP under accelerate/torchrun (each rank its own engine, TRL's external launcher
layout). Not supported, with a NotImplementedError: DeepSpeed ZeRO-3 and FSDP (the trainer holds
shards, not the weights an engine serves), vLLM server mode, vLLM's own sleep mode (colo sleeps the
KV cache itself and never moves the weights).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import warnings

import torch

from .clipping import refuse_non_finite_steps
from .share_check import EngineMismatch
from .trl_importance import DEFERRED_KEYS, SamplingMetrics, importance_ratio, steps_are_aligned, token_mask
from .trl_vision import EnginePrompts, unexpanded_prompt_ids

TESTED_TRL_VERSION = "1.16.0"
logger = logging.getLogger(__name__)


def _import_trl():
    try:
        import trl
        from trl.generation.vllm_generation import VLLMGeneration
    except ImportError as e:
        raise ImportError(f"colo.trl needs TRL {TESTED_TRL_VERSION}: pip install -e \".[trl]\" ({e})") from e
    return trl, VLLMGeneration


# TRL's private methods colo.trl overrides, and why (its own helpers are named _colo_*). A release that
# renames one would leave colo's override unused: check_trl_surface refuses it at import.
TRL_PRIVATE_OVERRIDES = {
    "_init_vllm": "VLLMGeneration: colo's engine (colo.engine.build_llm, share_weights) instead of vllm.LLM",
    "_generate": "the KV cache awake through a tool loop's turns, asleep after the round",
    "_generate_and_score_completions": "colo/skipped_steps in TRL's metrics; GRPO: its importance ratio from the "
                                       "training forward (one log-probability pass) and the engine's routes",
    "_load_from_checkpoint": "a PEFT adapter's checkpoint written into the engine's LoRA slot",
    "_save": "the fp32 masters saved, not their 16-bit rounding",
    "_tokenize_prompts": "GRPO: image prompts kept as the chat template wrote them, for the engine to expand",
    "_get_per_token_logps_and_entropies": "GRPO: routing replay, and the importance ratio from its result",
}
# TRL's private attributes colo.trl reads or sets: _metrics (its metrics), _last_loaded_step (one sync an
# optimizer step), _dist (VLLMGeneration's ZeRO-3/FSDP state), _env_tools and _batch_environments (GRPO's
# tools per prompt, for image prompts).


def trl_private_overrides(cls) -> list[str]:
    """The private methods of TRL's that colo's class `cls` (and its colo bases) override."""
    return sorted({name for klass in cls.__mro__ if klass.__module__ == __name__ for name in vars(klass)
                   if name.startswith("_") and not name.startswith(("__", "_colo"))})


def check_trl_surface(classes) -> None:
    """Refuse a TRL that lacks a private method colo overrides (ImportError naming it); warn, naming
    what to check, on a release other than the tested one."""
    missing = []
    for cls in classes:
        trl_class = next(c for c in cls.__mro__ if c.__module__.startswith("trl."))
        missing += [f"{trl_class.__name__}.{name}" for name in trl_private_overrides(cls) if not hasattr(trl_class, name)]
    if missing:
        raise ImportError(f"colo.trl overrides {', '.join(missing)}, which TRL {trl.__version__} does not have: this "
                          f"release changed what colo.trl replaces. Install trl=={TESTED_TRL_VERSION}")
    if trl.__version__.split("+")[0] != TESTED_TRL_VERSION:
        warnings.warn(f"colo.trl is tested with TRL {TESTED_TRL_VERSION}, found {trl.__version__}. Its overrides of "
                      f"TRL's {', '.join(sorted(TRL_PRIVATE_OVERRIDES))} (colo.trl.TRL_PRIVATE_OVERRIDES) still "
                      "exist here; check that their signatures and TRL's VLLMGeneration keyword arguments did not "
                      f"change, or install trl=={TESTED_TRL_VERSION}", stacklevel=3)


trl, _VLLMGeneration = _import_trl()


class ColoVLLMGeneration(_VLLMGeneration):
    """TRL's VLLMGeneration with the engine built and shared by colo (colocate mode only)."""

    def __init__(self, *args, pool=None, engine_dtype=None, fp32_masters=False, engine_options=None,
                 share_check: bool = True, **kwargs):
        self.colo_pool, self.colo_engine_dtype, self.colo_fp32_masters = pool, engine_dtype, fp32_masters
        self.colo_share_check = share_check   # colo.share_check at share time (colo_share_check=False: off)
        self.colo_engine_options = dict(engine_options or {})  # more vllm.LLM options (e.g. enforce_eager)
        self.colo_masters: dict = {}  # parameter -> its fp32 values, for TRL's optimizer (fp32_masters)
        self.colo_views = None    # what TRL trains, a colo.shared.EngineViews: the weights, or PEFT's adapter
        self.colo_generation_round = False  # inside GRPOTrainer._generate: several turns, one KV cache
        self._colo_workdir = None  # where the engine's adapter slot was first loaded from (PEFT)
        self.colo_sync_reports: list[dict] = []
        self.colo_record_routes = False   # routing replay: keep each generation's routed experts
        self.colo_routes: list | None = None   # the last generation's, one per completion in TRL's order
        self.colo_engine_prompts = EnginePrompts()  # image prompts as the engine gets them (colo.trl_vision)
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        import colo
        from colo.engine import sleep_kv_cache
        from trl.trainer.utils import ensure_master_addr_port

        if self.mode != "colocate":
            raise NotImplementedError(f"colo.trl runs vLLM in the training process (vllm_mode='colocate'), not "
                                      f"{self.mode!r}")
        if self.enable_sleep_mode:
            raise NotImplementedError("colo.trl sleeps the KV cache itself and never moves the weights; set "
                                      "vllm_enable_sleep_mode=False")
        if self._dist.is_zero3 or self._dist.is_fsdp:
            raise NotImplementedError("colo.trl shares whole weights with the engine: DeepSpeed ZeRO-3 and FSDP hold "
                                      "shards; use a single process or DDP (each rank its own engine)")
        model = self.accelerator.unwrap_model(self.model)
        accelerator = self.accelerator
        lora = None
        if _is_peft(model):
            from colo.lora import peft_lora_spec

            lora = peft_lora_spec(model)  # before any engine starts: what colo cannot share is refused here
            if self.tensor_parallel_size > 1:
                raise NotImplementedError("colo.trl shares a PEFT adapter with a single-rank engine "
                                          "(vllm_tensor_parallel_size=1)")
        if accelerator.num_processes % self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must divide world size "
                             f"({accelerator.num_processes}) evenly.")
        if self.tensor_parallel_size > 1:
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(i * self.tensor_parallel_size, (i + 1) * self.tensor_parallel_size))
                 for i in range(accelerator.num_processes // self.tensor_parallel_size)])
        extra = dict(self.colo_engine_options)
        if accelerator.num_processes > 1:
            # As TRL does for its external launcher: vLLM reads the layout from the environment. (A
            # single process needs none, and leaves the environment as it was.)
            os.environ["RANK"] = str(accelerator.process_index)
            os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
            os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
            ensure_master_addr_port()
            extra["distributed_executor_backend"] = "external_launcher"

        dtype = self.colo_engine_dtype or next(model.parameters()).dtype
        # The engine goes where accelerate will train the model ("cpu:N" is the CPU: tensors carry no index).
        device = accelerator.device if accelerator.device.type != "cpu" else torch.device("cpu")
        if next(model.parameters()).device != device:
            model.to(device)
        with _base_model(model) as base:
            if lora is not None:
                base.to(dtype)  # the frozen base, in the engine's dtype; the adapter's masters are fp32 below
            elif self.colo_fp32_masters:
                # The fp32 values become the optimizer's masters (kept, not copied); the parameters become
                # 16-bit, and then views of the engine's tensors.
                self.colo_masters = {p: p.data for p in model.parameters()}
                model.to(dtype)
            self._colo_build_llm(base, dtype, device, lora, extra)
            try:
                self.colo_views = colo.share_weights(base, self.llm, check_logprobs=self.colo_share_check)
            except EngineMismatch as e:
                raise EngineMismatch(f"{e.message}; GRPOTrainer(colo_share_check=False) trains anyway", e.gap,
                                     e.after_publish, how_to_skip=None) from None
        if lora is not None:  # the adapter's views, on the base's (colo_views.weights)
            import tempfile

            from colo.lora import share_peft_adapter

            self._colo_workdir = tempfile.TemporaryDirectory(prefix="colo-trl-")
            self.colo_views, self.colo_masters = share_peft_adapter(model, self.llm, self._colo_workdir.name)
        self._llm_weights_sleeping = False
        sleep_kv_cache(self.llm)  # training comes first in TRL's loop only after a generation
        accelerator.wait_for_everyone()

    def _colo_build_llm(self, model, dtype, device, lora, extra) -> None:
        import colo
        from colo.engine import build_llm
        from colo.kv_sizing import default_block_size, kv_bytes_per_token, kv_cache_budget
        from colo.sizes import device_memory_bytes

        accelerator = self.accelerator
        pool = self.colo_pool if self.colo_pool is not None else colo.Pool(device)
        config = model.config
        max_model_len = self.max_model_length or getattr(config.get_text_config(), "max_position_embeddings", 2048)
        block = default_block_size(pool.device)
        # The KV cache holds the whole generation batch at full length (and vLLM's null block: one block
        # short, a sequence is preempted every generation and recomputed) where that fits in TRL's
        # memory fraction less the weights. Without vllm_max_model_length the full length is the
        # model's (often thousands of tokens), and then the fraction caps it as it caps stock vLLM's.
        sequences = self.max_num_seqs or 1
        kv_cache_bytes, held = kv_cache_budget(
            sequences, max_model_len, block, kv_bytes_per_token(config, dtype, self.tensor_parallel_size),
            memory_fraction=self.gpu_memory_utilization, device_bytes=device_memory_bytes(pool.device),
            weight_bytes=sum(p.numel() for p in model.parameters()) * dtype.itemsize // self.tensor_parallel_size)
        if held < sequences:
            # vLLM gives a sequence blocks as it grows, so shorter sequences than the full length share it
            # and run together; only sequences that outgrow it are preempted (recomputed later)
            logger.info("colo.trl: the KV cache holds %d of the %d sequences of a generation at their full %d "
                        "tokens (vllm_gpu_memory_utilization=%s of this device's memory, less the weights); shorter "
                        "ones share it. vllm_max_model_length (the longest prompt plus max_completion_length) sizes "
                        "it for the whole batch", held, sequences, max_model_len, self.gpu_memory_utilization)
        self.llm = build_llm(
            model.name_or_path, pool, dtype=dtype, kv_cache_bytes=kv_cache_bytes, block_size=block,
            tensor_parallel_size=self.tensor_parallel_size, max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs, model_impl=self.model_impl,
            seed=accelerator.process_index // self.tensor_parallel_size, max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs", trust_remote_code=self.trust_remote_code,
            load_format=_load_format(config),
            **(lora.engine_options() if lora is not None else {}), **extra)

    def sync_weights(self):
        """TRL's weight sync: the engine already reads the trainer's weights; publish() orders the
        streams, refreshes CPU kernel copies and resets the prefix cache.

        If the trainer's parameters were given new storage since they were shared, they are put back
        into the engine's tensors first (one copy, reported as `reshared_bytes`): accelerate's prepare()
        moves the model with .to(accelerator.device), and under torch.distributed on a CPU that device
        is "cpu:N", for which torch copies every parameter although nothing moves. What is published is
        what TRL trains (colo_views: with PEFT the adapter, in the engine's slot; the base is frozen)."""
        reshared = self.colo_views.reshare()  # (an adapter's base too)
        report = self.colo_views.publish()
        self.colo_sync_reports.append({**report, "reshared_bytes": reshared})

    def generate(self, prompts, images=None, *args, **kwargs):
        from colo.engine import kv_cache_region, wake_kv_cache

        if kv_cache_region(self.llm).asleep:
            wake_kv_cache(self.llm)
        try:
            if images is None:
                return self._colo_generate_recording_routes(prompts, images, *args, **kwargs)
            # The engine expands the images of the template's prompt itself (colo.trl_vision).
            sent = [self.colo_engine_prompts.for_engine(p) for p in prompts]
            result = self._colo_generate_recording_routes(sent, images, *args, **kwargs)
            EnginePrompts.check(prompts, result[0], images)
            return (list(prompts), *result[1:])
        finally:
            if not self.colo_generation_round:
                self._colo_end_generation()

    def _colo_generate_recording_routes(self, prompts, images, *args, **kwargs):
        if not self.colo_record_routes:
            return super().generate(prompts, images, *args, **kwargs)
        from colo.vllm_compat import recording_routes

        with recording_routes(self.llm) as capture:
            result = super().generate(prompts, images, *args, **kwargs)
            prompt_ids, completion_ids = result[0], result[1]
            held = list(capture.take_all().values()) if capture is not None else []
        if len(held) != len(completion_ids):
            raise RuntimeError(f"colo.trl: {len(held)} routed requests for {len(completion_ids)} completions")
        self.colo_routes = [routes[:len(p) + len(c) - 1] for routes, p, c in zip(held, prompt_ids, completion_ids)]
        return result

    def _colo_end_generation(self) -> None:
        self.colo_engine_prompts.clear()
        self.sleep_kv_cache()  # TRL trains next: the KV cache's memory is released until then

    @contextlib.contextmanager
    def generation_round(self):
        """One round of TRL's generation, every turn of its tool loop included: the KV cache stays awake
        between the turns (vLLM's prefix cache then serves each turn's earlier tokens) and sleeps after."""
        self.colo_generation_round = True
        try:
            yield
        finally:
            self.colo_generation_round = False
            self._colo_end_generation()

    def sleep_kv_cache(self) -> None:
        """Release the KV cache's memory if it is awake (the next request wakes it again)."""
        from colo.engine import kv_cache_region, sleep_kv_cache

        if not kv_cache_region(self.llm).asleep:
            sleep_kv_cache(self.llm)


def _frames_in_this_module() -> int:
    """How many frames up from the caller's are this module's (a trainer's __init__ and its bases')."""
    frame, count = sys._getframe(1), 0
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        count, frame = count + 1, frame.f_back
    return count


def _aligned_routes(routes: list, prompt_mask: torch.Tensor, completion_columns: int) -> torch.Tensor:
    """TRL's layout of the routes (prompts left-padded to the prompt columns, completions after): one row
    per completion, [rows, prompt + completion columns, MoE layers, top_k], -1 where no token is."""
    rows, prompt_columns = prompt_mask.shape
    out = torch.full((rows, prompt_columns + completion_columns, *routes[0].shape[1:]), -1, dtype=torch.int16)
    lengths = prompt_mask.sum(1).tolist()
    for i, (route, length) in enumerate(zip(routes, lengths)):
        start = prompt_columns - int(length)
        n = min(route.shape[0], out.shape[1] - start)
        out[i, start:start + n] = route[:n]
    return out.to(prompt_mask.device)


def _is_peft(model) -> bool:
    return isinstance(getattr(model, "peft_config", None), dict)


def _base_model(model):
    """A context giving the Hugging Face model whose weights the engine serves: a PEFT model's base
    (its LoRA wrappers swapped for their linear layers inside the block), or the model itself."""
    import contextlib

    if _is_peft(model):
        from colo.lora import peft_base_layers

        return peft_base_layers(model)
    return contextlib.nullcontext(model)


def _say_fp32_in_config(directory) -> None:
    """save_pretrained writes the parameters' dtype (bf16) into config.json; the weights saved are the
    fp32 masters, and from_pretrained loads in the dtype config.json names."""
    import json
    from pathlib import Path

    path = Path(directory) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        config["dtype"] = "float32"
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def autocast_warning(args, device) -> str | None:
    """What bf16=True (TRL's default: training under bf16 autocast) costs where bf16 is not the fast dtype
    on this CPU (no bf16 instructions, or measured slower than fp32), measured here, and the fix; None
    where it does not apply. Said once per process."""
    from .dtype_choice import fastest_dtype, measured_bf16_slowdown

    if not getattr(args, "bf16", False) or torch.device(device).type != "cpu" or "autocast" in _WARNED:
        return None
    choice = fastest_dtype(device)
    if choice.dtype == torch.bfloat16:
        return None
    _WARNED.add("autocast")
    cost = "" if choice.timed else (f": a 512x512 matmul and its backward took {measured_bf16_slowdown():.1f}x as "
                                    "long in bf16 as in fp32 on one core here")
    return (f"colo.trl: bf16=True trains under bf16 autocast, but {choice.reason}{cost}. Pass bf16=False in "
            "trl.GRPOConfig to train in fp32 (colo.trl's engine already serves fp32 on this CPU).")


_WARNED: set[str] = set()


def choose_engine_dtype(model, args, asked=None, device="cpu") -> tuple[torch.dtype, bool, str]:
    """(engine dtype, whether TRL's optimizer steps fp32 masters of bf16 weights, why), for a trainer
    whose model is `model` and whose TRL config is `args`; `asked`: colo_engine_dtype."""
    from .dtype_choice import BY_NAME, fastest_dtype

    trained = next(model.parameters()).dtype
    # With PEFT the base is frozen in the engine's dtype and only the adapter has masters.
    with_masters = ("; the base frozen, PEFT's adapter in vLLM's LoRA slot with fp32 masters in TRL's optimizer"
                    if _is_peft(model) else "; fp32 masters in TRL's optimizer")
    if asked is not None:
        asked = BY_NAME.get(asked, asked) if isinstance(asked, str) else asked
        if asked not in BY_NAME.values():
            raise ValueError(f"colo_engine_dtype must be one of {sorted(BY_NAME)} or the torch dtype, "
                             f"got {asked!r}")
        masters = asked in (torch.bfloat16, torch.float16) and trained == torch.float32
        return asked, masters, "colo_engine_dtype" + (with_masters if masters else "")
    if trained != torch.float32:
        return trained, False, f"the trainer's {str(trained).removeprefix('torch.')}"
    explicit = (args.model_init_kwargs or {}).get("dtype")
    if explicit not in (None, "auto"):
        return trained, False, f"model_init_kwargs dtype={explicit}: the trainer's dtype"
    if not args.bf16:
        return trained, False, "bf16=False: the trainer's float32"
    if getattr(args, "cast_lm_head_to_fp32", False):
        return trained, False, "cast_lm_head_to_fp32: the trainer's float32"
    choice = fastest_dtype(device)
    if choice.dtype == torch.bfloat16:
        return torch.bfloat16, True, f"auto: {choice.reason}{with_masters}"
    return trained, False, f"auto: {choice.reason}"


class _ColocatedEngine:
    """What colo changes in any TRL trainer that generates through VLLMGeneration in colocate mode
    (GRPOTrainer, RLOOTrainer, DistillationTrainer): colo's engine built after TRL's own set-up, its
    optimizer over the engine's weights (fp32 masters where the engine is 16-bit), checkpoints of the
    masters, the KV cache asleep while TRL trains. Keyword arguments: colo_pool (a colo.Pool; default: a new one on the
    model's device), colo_engine_dtype (default: choose_engine_dtype's choice, said at start and kept
    in `colo_engine_dtype_reason`), colo_engine_options (more vllm.LLM options, e.g.
    {"enforce_eager": True}: TRL's config has no field for them) and colo_share_check (False: the
    engine's and the trainer's log-probabilities are not compared at share time, colo.share_check)."""

    _colo_engine_logprobs: int | None = 0  # what TRL's trainer asks the engine for (its VLLMGeneration's)
    # The config field counting the micro-batches one of TRL's generations serves (its max_num_seqs' factor).
    _colo_batches_per_generation = "steps_per_generation"
    _colo_vision_language = True  # whether the trainer takes a vision-language model (colo.trl_vision)

    def __init__(self, *args, colo_pool=None, colo_engine_dtype=None, colo_engine_options=None,
                 colo_share_check: bool = True, **kwargs):
        config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        trl_class = next(c for c in type(self).__mro__ if c.__module__.startswith("trl."))
        trainer, config_class = type(self).__name__, trl_class.__name__.replace("Trainer", "Config")
        if config is None or not config.use_vllm or config.vllm_mode != "colocate":
            raise ValueError(f"colo.trl.{trainer} is TRL's colocate mode: pass args=trl.{config_class}(use_vllm=True, "
                             "vllm_mode='colocate', ...)")
        self.colo_fp32_masters = None  # colo.optimizer_masters.FP32Masters, once TRL's optimizer exists
        self.colo_step_guard = None    # colo.clipping.NonFiniteStepGuard on TRL's optimizer (skipped_steps)
        # TRL builds its own engine in __init__ when use_vllm is set (and reads it there only); colo's is
        # built after it. TRL gets a copy of the config saying use_vllm=False and keeps it as self.args,
        # saying use_vllm=True again: the user's config object is left as it was.
        trl_config = copy.copy(config)
        trl_config.use_vllm = False
        if "args" in kwargs:
            kwargs["args"] = trl_config
        else:
            args = (*args[:2], trl_config, *args[3:])
        super().__init__(*args, **kwargs)
        self.args.use_vllm = self.use_vllm = True
        args = self.args
        model = self.accelerator.unwrap_model(self.model)
        from .model_classes import is_vision_language
        from .shared import check_model_config

        # What colo does not train is refused here, before any engine starts; whether each weight is
        # shared or copied is read from the engine once it is up (colo.share_weights).
        check_model_config(model.config)
        if not self._colo_vision_language and is_vision_language(model.config):
            raise NotImplementedError(f"colo.trl.{trainer} trains text models; a vision-language model trains "
                                      "with colo.trl.GRPOTrainer")
        colo_engine_options = self._colo_engine_options(model, args, colo_engine_options or {})
        engine_dtype, fp32_masters, self.colo_engine_dtype_reason = choose_engine_dtype(
            model, args, colo_engine_dtype, self.accelerator.device)
        if self.accelerator.is_main_process:
            print(f"colo.trl: engine weights in {engine_dtype} ({self.colo_engine_dtype_reason})", flush=True)
            warning = autocast_warning(args, self.accelerator.device)
            if warning:
                warnings.warn(warning, stacklevel=_frames_in_this_module() + 1)  # the user's line
        self.vllm_generation = ColoVLLMGeneration(
            model=self.model, accelerator=self.accelerator, processing_class=self.processing_class,
            pool=colo_pool, engine_dtype=engine_dtype, fp32_masters=fp32_masters, engine_options=colo_engine_options,
            share_check=colo_share_check,
            mode=args.vllm_mode, structured_outputs_regex=args.vllm_structured_outputs_regex,
            tensor_parallel_size=args.vllm_tensor_parallel_size, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_length=args.vllm_max_model_length,
            max_num_seqs=(args.per_device_train_batch_size * args.vllm_tensor_parallel_size
                          * getattr(args, self._colo_batches_per_generation)),
            enable_sleep_mode=args.vllm_enable_sleep_mode, model_impl=args.vllm_model_impl,
            trust_remote_code=args.trust_remote_code, repetition_penalty=self.repetition_penalty,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_completion_length=self.max_completion_length, logprobs=self._colo_engine_logprobs,
            generation_kwargs=args.generation_kwargs)
        from .vllm_compat import run_as_plain_modules

        for frozen in ("ref_model", "teacher_model"):  # TRL's, built before the engine as the policy was
            if getattr(self, frozen, None) is not None:
                run_as_plain_modules(self.accelerator.unwrap_model(getattr(self, frozen)))
        self._last_loaded_step = -1  # as TRL: sync once per optimizer step, not per micro-batch

    def _colo_engine_options(self, model, args, options: dict) -> dict:
        """The engine's vllm.LLM options beyond TRL's, from the user's colo_engine_options."""
        return dict(options)

    def create_optimizer(self, model=None):
        """TRL's optimizer, as TRL builds it; with a bf16 engine for an fp32 model, stepping the
        model's fp32 values (masters) and rounding them into the shared bf16 weights. Either way it
        skips a step on gradients that are not finite: the weights it steps are the engine's."""
        optimizer = super().create_optimizer(model)
        if self.colo_step_guard is not None:
            return optimizer
        masters = self.vllm_generation.colo_masters
        if masters:
            from .optimizer_masters import FP32Masters

            # (an adapter's slot holds alpha/r x PEFT's B: its scales)
            self.colo_fp32_masters = FP32Masters(optimizer, masters, scales=self.vllm_generation.colo_views.scales())
            self.colo_step_guard = self.colo_fp32_masters.guard
        else:
            self.colo_step_guard = refuse_non_finite_steps(optimizer)
        return optimizer

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # The views restore what the Trainer's loading would cut off the engine (an adapter: its slot);
        # whole weights load in place, their parameters being the engine's tensors.
        views = self.vllm_generation.colo_views
        if not views.load_trainer_checkpoint(resume_from_checkpoint, self.vllm_generation.colo_masters):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save(self, output_dir=None, state_dict=None):
        # With fp32 masters, the trained model is the masters (the bf16 weights are their rounding).
        masters = self.vllm_generation.colo_masters
        if masters and state_dict is None:
            model = self.accelerator.unwrap_model(self.model)
            state_dict = model.state_dict()
            for name, param in model.named_parameters(remove_duplicate=False):
                if param in masters:
                    state_dict[name] = masters[param].detach()
        super()._save(output_dir, state_dict=state_dict)
        if masters and self.args.should_save and not _is_peft(self.accelerator.unwrap_model(self.model)):
            _say_fp32_in_config(output_dir or self.args.output_dir)

    def _generate(self, prompts):
        # TRL's tool loop calls generate() once per turn: the KV cache stays awake for the whole round,
        # so vLLM's prefix cache keeps the earlier turns (it sleeps after, as after any generation).
        with self.vllm_generation.generation_round():
            return super()._generate(prompts)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.colo_step_guard is not None and self.model.training:
            self._metrics["train"]["colo/skipped_steps"].append(self.colo_step_guard.skipped_steps)
        return output

    def compute_loss(self, model, inputs, *args, **kwargs):
        # TRL trains now: a KV cache woken outside TRL's generate (a user's llm.generate, an eval
        # callback: colo's engine wakes it on demand) is released again for the training memory.
        self.vllm_generation.sleep_kv_cache()
        return super().compute_loss(model, inputs, *args, **kwargs)

    @property
    def colo_shared(self):
        """The SharedWeights between the trainer's model and the engine (copy_bytes, aliased_bytes, ...;
        with PEFT, the base's)."""
        return self.vllm_generation.colo_views.weights


class GRPOTrainer(_ColocatedEngine, trl.GRPOTrainer):
    """trl.GRPOTrainer whose colocated vLLM engine is colo's (see the module docstring).

    Extra keyword arguments: those of _ColocatedEngine (colo_pool, colo_engine_dtype, colo_engine_options,
    colo_share_check), colo_routing_replay (MoE models: TRL's log-probability passes route each token
    to the experts the engine routed it to, as colo.grpo's --routing-replay; TRL's metrics get
    `colo/router_mismatch`) and colo_one_logprob_pass (False: TRL's no-grad log-probability pass for
    its vLLM importance-sampling ratio runs even where its steps are aligned; by default the ratio comes
    from the training forward there, colo.trl_importance).
    """

    def __init__(self, *args, colo_routing_replay: bool = False, colo_one_logprob_pass: bool = True, **kwargs):
        self.colo_one_logprob_pass = colo_one_logprob_pass
        self._colo_ratio_inputs = None  # the batch whose importance-sampling ratio its training forward gives
        self._colo_sampling_metrics = SamplingMetrics()
        self._colo_wants_routing_replay = colo_routing_replay
        self.colo_router_replay = None
        self._colo_routes = None   # the routes of the rows being computed (routing replay)
        super().__init__(*args, **kwargs)
        from .trl_vision import attend_images_as_the_engine

        model = self.accelerator.unwrap_model(self.model)
        self.colo_causal_images = attend_images_as_the_engine(
            self.vllm_generation.llm, [model] + ([self.ref_model] if getattr(self, "ref_model", None) else []))
        self.vllm_generation.colo_record_routes = self.colo_router_replay is not None

    def _colo_engine_options(self, model, args, options: dict) -> dict:
        if not self._colo_wants_routing_replay:
            return dict(options)
        from .vllm_compat import engine_routing_options

        self.colo_router_replay = self._colo_check_routing_replay(model, args)
        return {**engine_routing_options(self.accelerator.device.type), **options}

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        if images is not None:
            tools = ([self._env_tools[name] for name in self._batch_environments]
                     if self.environment_factories is not None else [self.tools] * len(prompts))
            self.vllm_generation.colo_engine_prompts.add(prompt_ids, unexpanded_prompt_ids(
                self.processing_class, prompts, tools_per_prompt=tools, chat_template=self.chat_template,
                chat_template_kwargs=self.chat_template_kwargs))
        return prompt_ids, images, multimodal_fields

    # -- routing replay ------------------------------------------------------------------------------
    @staticmethod
    def _colo_check_routing_replay(model, args):
        from .moe_routing import RouterReplay, is_moe

        if not is_moe(model):
            raise ValueError("colo_routing_replay: the model has no MoE layers; there is no routing to replay")
        if args.gradient_checkpointing:
            raise NotImplementedError("colo_routing_replay with gradient_checkpointing=True (TRL's default): the "
                                      "recomputed layers would route on their own; set gradient_checkpointing=False")
        if args.vllm_tensor_parallel_size > 1:
            raise NotImplementedError("colo_routing_replay with vllm_tensor_parallel_size > 1")
        return RouterReplay.attach(model)

    def _generate_and_score_completions(self, inputs):
        self._colo_log_sampling_metrics()  # the batch trained before this one
        self._colo_generating = self.colo_router_replay is not None
        # Aligned steps: TRL's no-grad pass would compute the training forward's log-probabilities
        # again; the ratio comes from that forward instead (colo.trl_importance). TRL reads the flag
        # below only to decide on that pass, its ratio and their metrics.
        one_pass = (self.colo_one_logprob_pass and self.vllm_importance_sampling_correction
                    and steps_are_aligned(self.args, self.num_iterations))
        if one_pass:
            self.vllm_importance_sampling_correction = False
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._colo_generating = False
            if one_pass:
                self.vllm_importance_sampling_correction = True
        if self.colo_router_replay is not None:   # carried with the rows through TRL's split and shuffle
            output["colo_routes"] = _aligned_routes(self.vllm_generation.colo_routes, output["prompt_mask"],
                                                    output["completion_ids"].shape[1])
            self.vllm_generation.colo_routes = None
            self._metrics["train"]["colo/router_mismatch"].append(self.colo_router_replay.stats()["router_mismatch"])
        return output

    def training_step(self, model, inputs, num_items_in_batch=None):
        # compute_loss enters the engine's routing for the micro-batch it gets (TRL prepares it in there);
        # it stays in force through the backward, then ends here.
        self._colo_step_routing = contextlib.ExitStack()
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._colo_step_routing.close()
            self._colo_routes = None

    def compute_loss(self, model, inputs, *args, **kwargs):
        routes = inputs.get("colo_routes") if self.colo_router_replay is not None else None
        if routes is not None and getattr(self, "_colo_step_routing", None) is not None:
            self._colo_routes = routes
            self._colo_step_routing.enter_context(self.colo_router_replay.forcing(routes))
        if self.vllm_importance_sampling_correction and not any(key in inputs for key in DEFERRED_KEYS):
            self._colo_ratio_inputs = inputs  # its ratio, from the forward TRL's loss runs first
        try:
            return super().compute_loss(model, inputs, *args, **kwargs)
        finally:
            self._colo_ratio_inputs = None

    def _colo_fill_importance_ratio(self, per_token_logps) -> None:
        """TRL's vLLM importance-sampling ratio of the batch being trained, from its training forward."""
        inputs, self._colo_ratio_inputs = self._colo_ratio_inputs, None
        mask, mode = token_mask(inputs), self.vllm_importance_sampling_mode
        trainer_logps, sampling_logps = per_token_logps.detach(), inputs["sampling_per_token_logps"]
        ratio = importance_ratio(trainer_logps, sampling_logps, mask, mode,
                                 self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)
        inputs["importance_sampling_ratio"] = ratio
        self._colo_sampling_metrics.add("train" if self.model.training else "eval", trainer_logps, sampling_logps,
                                        mask, ratio, mode)

    def _colo_log_sampling_metrics(self) -> None:
        gather = lambda t: self.accelerator.gather(t.to(self.accelerator.device))  # noqa: E731
        for mode, values in self._colo_sampling_metrics.flush(gather).items():
            for name, value in values.items():
                self._metrics[mode][name].append(value)

    def log(self, logs, start_time=None):
        self._colo_log_sampling_metrics()  # every micro-batch of the step has trained
        return super().log(logs, start_time)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        routes = self._colo_routes
        if routes is None and getattr(self, "_colo_generating", False) and self.vllm_generation.colo_routes:
            # TRL's passes inside the generation step (old and reference log-probabilities): its rows are
            # the generation's, in order.
            prompt_mask = attention_mask[:, :input_ids.shape[1] - logits_to_keep]
            routes = _aligned_routes(self.vllm_generation.colo_routes, prompt_mask, logits_to_keep).to(input_ids.device)
        if routes is None or self.colo_router_replay is None:
            result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                batch_size, **kwargs)
        else:
            result = self._colo_logps_on_routes(routes, model, input_ids, attention_mask, logits_to_keep,
                                                batch_size, **kwargs)
        if getattr(self, "_colo_ratio_inputs", None) is not None:
            self._colo_fill_importance_ratio(result[0])
        return result

    def _colo_logps_on_routes(self, routes, model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs):
        if any(value is not None for value in kwargs.values() if not isinstance(value, bool)):
            raise NotImplementedError("colo_routing_replay with images in the batch")
        size = batch_size or input_ids.shape[0]
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.shape[0], size):
            rows = slice(start, start + size)
            with self.colo_router_replay.forcing(routes[rows]):
                part = super()._get_per_token_logps_and_entropies(model, input_ids[rows], attention_mask[rows],
                                                                  logits_to_keep, None, **kwargs)
            logps.append(part[0])
            entropies.append(part[1])
            aux.append(part[2])
        return (torch.cat(logps), None if entropies[0] is None else torch.cat(entropies),
                None if aux[0] is None else torch.stack(aux).mean())



class RLOOTrainer(_ColocatedEngine, trl.RLOOTrainer):
    """trl.RLOOTrainer whose colocated vLLM engine is colo's: the same one copy of the weights, 0 bytes
    per sync, fp32 masters, KV cache sleep and non-finite step guard as colo.trl.GRPOTrainer (keyword
    arguments: colo_pool, colo_engine_dtype, colo_engine_options, colo_share_check). TRL's RLOO asks the
    engine for no log-probabilities (it has no importance-sampling correction), so there is no
    log-probability pass to save. A vision-language model is refused: its image prompts would reach the
    engine as TRL's processor expanded them (colo.trl_vision is GRPOTrainer's)."""

    _colo_engine_logprobs = None
    _colo_vision_language = False


class DistillationTrainer(_ColocatedEngine, trl.DistillationTrainer):
    """trl.DistillationTrainer (on-policy distillation: the student samples completions, and learns the
    frozen teacher's next-token distribution on them, TRL's generalized JSD) whose colocated engine is
    colo's: the student's one copy of the weights, 0 bytes per sync, fp32 masters, KV cache sleep and
    non-finite step guard as colo.trl.GRPOTrainer (keyword arguments: colo_pool, colo_engine_dtype,
    colo_engine_options, colo_share_check). The teacher is TRL's: a model beside the engine, resident
    through the step (it is not in the pool and does not sleep while the student generates). A
    vision-language student is refused, as RLOOTrainer refuses one."""

    _colo_engine_logprobs = None  # TRL's distillation asks the engine for none: the teacher scores
    # One completion per prompt, a generation for every optimizer step (TRL's DistillationTrainer).
    _colo_batches_per_generation = "gradient_accumulation_steps"
    _colo_vision_language = False


def _load_format(config) -> str:
    """How the engine loads its weights before share_weights writes the trainer's into them: "dummy" (no
    read) for text models. A vision-language model's engine reads its checkpoint: vLLM's dummy loader
    also randomizes the modules' persistent buffers, which no weight fills and share_weights does not
    write (a Qwen2.5-VL vision tower's, seen as a 0.21 log-probability gap on image prompts, none on text)."""
    from .model_classes import is_vision_language

    return "auto" if is_vision_language(config) else "dummy"


check_trl_surface((ColoVLLMGeneration, GRPOTrainer, RLOOTrainer, DistillationTrainer))
