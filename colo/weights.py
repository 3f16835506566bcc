"""One copy of the weights for a Hugging Face causal LM and an in-process vLLM engine, for any model
family both implement, dense or MoE.

    shared = colo.shared_model(llm)                # a HF model whose parameters are the engine's tensors
    model = shared.hf_model                        # train it with any torch optimizer
    shared.publish()                               # the engine serves the new weights; 0 bytes copied

    shared = colo.share_weights(hf_model, llm)     # or: an existing HF model's values go into the engine
                                                   # once, then its parameters become views of it

The engine's tensors never move: colo.engine.build_llm allocated them in the pool's `weights` region
while vLLM loaded the model, and compiled code captured them there. Where each Hugging Face parameter
lives among them is read from vLLM's own loader (colo.vllm_compat.engine_layout), so whatever a family
fuses or renames is followed: the trainer's `q_proj.weight` is rows [0, q) of the engine's fused
`qkv_proj.weight`, a MoE layer's `experts.gate_up_proj` [E, 2I, H] is the engine's `w13_weight`. An
existing model's parameters keep their identity (`param.data` is re-pointed), so an optimizer built
before sharing keeps working.

When a parameter cannot alias (its dtype differs from the engine's, the engine holds a tensor-parallel
shard of it, or the engine's layout of it is not one view, e.g. gate and up rows padded apart), the
trainer keeps its own tensor and publish() copies it into the engine on the pool's copy stream, from a
plan made once at share time: same-dtype contiguous pieces as one batch of byte copies
(`Stream.copy_async`), the rest as a few large `torch._foreach_copy_` buckets. A parameter whose engine
values vLLM's loader computes (not a copy) is loaded through vLLM's `load_weights` at each publish. The
copy path is never a refusal: it is said once in a warning naming the tensors and the bytes each
publish copies. On CPU, where vLLM's kernels read packed copies of the linear and expert weights,
publish() also repacks those copies in place from the shared weights (`bytes_repacked`).

At share time the engine's and the trainer's log-probabilities of a few tokens are compared
(`check_logprobs`): a family whose vLLM and transformers implementations disagree (a config field one
of them ignores) is refused before the first step, not trained off-policy.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import vllm_compat as compat
from .checks import check_int
from .engine import reset_prefix_cache
from .hf_names import read_checkpoint_tensors
from .model_classes import trainer_auto_class, vision_tower_parameters
from .regions import WEIGHTS, region_for
from .shared import (EngineViews, Placed, PublishReport, check_model_config, materialize_buffers,  # noqa: F401
                     meta_model, no_parameter_for, no_place_for, shape_mismatch)
from .sizes import shape_bytes

logger = logging.getLogger(__name__)

# Config fields that change what the same weights compute; parameter shapes cannot reveal them.
_CONFIG_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                  "rope_parameters", "rope_theta")


@dataclass
class _Source:
    """A validated Hugging Face parameter: where it lives in the engine and whether it is a view there."""
    name: str
    param: torch.nn.Parameter
    placement: compat.Placement
    alias: bool


class _Engine(NamedTuple):
    """What share_weights reads of the engine."""
    placement: compat.EnginePlacement | None   # None: an engine colo did not build
    layout: compat.EngineLayout
    model: torch.nn.Module
    device: torch.device
    tied_heads: dict[str, str]   # engine LM head -> the trainer's embedding, which the trainer ties its head to


class SharedWeights(EngineViews):
    """The result of `share_weights` / `shared_model`; call `publish()` after each optimizer step.

    aliased_bytes: HF bytes that are views of the engine's tensors (never copied); copy_bytes: bytes
    publish() copies each time (0 when all alias); packed_bytes: CPU weight bytes publish() repacks
    into vLLM's kernel layouts; shared_once_bytes: bytes share_weights copied from the trainer into the
    engine; copied: the trainer parameters publish() copies (the copy path), with why; superseded: a
    later share_weights on the same engine took the weights over; alias: False where the trainer keeps
    its own tensors (share_weights' alias=False)."""

    def __init__(self, hf_model, llm, pool, *, alias: bool = True, **engine_state):
        super().__init__(llm, hf_model, shared_by="colo.share_weights")
        self.alias = alias
        self._bind(llm, pool, **engine_state)

    def _bind(self, llm, pool, *, copies: "_CopyPlan", loads: "_LoaderLoads", aliased_bytes: int, copy_bytes: int,
              packed_bytes: int, shared_once_bytes: int, repack, copied: dict[str, str]) -> None:
        """What these views hold of `llm` (share_weights' plan for it): set once, and again by rebind."""
        self.llm, self.pool = llm, pool
        self.aliased_bytes, self.copy_bytes = aliased_bytes, copy_bytes
        self.packed_bytes, self.shared_once_bytes = packed_bytes, shared_once_bytes
        self.copied, self.superseded = copied, False
        self._copies, self._loads, self._repack = copies, loads, list(repack)  # what publish() copies, planned once
        # Every name, a tied head's too: a checkpoint of the whole model holds both, as state_dict() does.
        self.watch({name: Placed(p, tuple(p.shape))
                    for name, p in self.hf_model.named_parameters(remove_duplicate=False)})

    def rebind(self, llm) -> None:
        _share(self.hf_model, llm, None, alias=self.alias, into=self)  # the values written in, then views

    def _saved_buffers(self) -> dict:
        return compat.persistent_buffers(self.hf_model)

    def _detach_kind(self) -> None:
        self._copies = self._loads = None  # they hold the engine's tensors

    def _check_served(self) -> None:
        if self.superseded:
            raise RuntimeError("a later colo.share_weights on this engine took its weights over; publish with "
                               "the SharedWeights that call returned")

    def _publish_copies(self) -> dict:
        """Orders the training stream before inference, copying or casting the non-aliased parameters
        on the copy stream in between."""
        train, infer = self.pool.stream("train"), self.pool.stream("infer")
        on_cuda = self.pool.device.type == "cuda"
        if on_cuda:  # the optimizer ran on torch's current stream: make it part of the training stream
            train.torch_stream().wait_stream(torch.cuda.current_stream(self.pool.device))
        ready = train.record()
        if self._copies.count:
            ready = self._copies.run(self.pool, after=ready)
        if self._loads.count:
            ready.synchronize()
            self._loads.run()
            ready = train.record()
        infer.wait(ready)
        if on_cuda:  # vLLM launches on torch's current stream
            torch.cuda.current_stream(self.pool.device).wait_stream(infer.torch_stream())
        else:
            ready.synchronize()  # vLLM runs in this thread on the host
        return dict(bytes_copied=self.copy_bytes, aliased_bytes=self.aliased_bytes,
                    copied_tensors=self._copies.count + self._loads.count, buckets=self._copies.batches)


def shared_model(llm, dtype: torch.dtype | None = None, *, bucket_bytes: int = 256 << 20,
                 check_logprobs: bool = True) -> SharedWeights:
    """A Hugging Face model built from the engine's config whose parameters are the engine's own
    tensors: nothing is read from disk and nothing is copied (in the engine's dtype). Its `.hf_model`
    is in training mode, ready for an optimizer.

    A parameter whose engine values vLLM's loader computes rather than holds (Falcon's fused QKV, which
    it reorders) cannot be read back from the engine: those are read once from the engine's checkpoint,
    and publish() hands them to the loader (the copy path; `copied` names them).

    dtype: the trainer's dtype (default: the engine's). Parameters in another dtype than the
    engine's cannot alias; they are the engine's values cast once, and publish() casts them back.
    """
    source = compat.engine_model_source(llm)
    hf_model = meta_model(compat.engine_config_as_saved(llm), dtype or compat.engine_dtype(llm),
                          checkpoint=source["pretrained_model_name_or_path"])
    return _share(hf_model.train(), llm, None, alias=True, bucket_bytes=bucket_bytes, check_logprobs=check_logprobs,
                  checkpoint=source)


def share_weights(hf_model, llm, pool=None, *, alias: bool = True, bucket_bytes: int = 256 << 20,
                  check_logprobs: bool = True) -> SharedWeights:
    """Make `hf_model` and the in-process engine of `llm` share one copy of the weights.

    hf_model: a transformers causal LM of a family vLLM serves. Its current values are what the engine
        serves from now on: they are written into the engine's tensors once (unless its parameters are
        on the meta device, as in `shared_model`), then its parameters become views.
    llm: a vllm.LLM running in this process, built by colo.engine.build_llm. An eager engine built
        otherwise also works: its weights are first moved into `pool` (default: a new one) and its
        CPU linears run torch.nn.functional.linear; a compiled one is refused (its compiled code
        holds the tensors it would lose).
    alias=False: the trainer keeps its own tensors and publish() copies them (for comparisons).
    bucket_bytes: the size of the copy buckets when parameters cannot alias.
    check_logprobs: compare the engine's and the trainer's log-probabilities of a few tokens once shared
        (colo.share_check), raising ValueError where they disagree beyond the dtype's rounding.

    Sharing an engine again (e.g. with a new model) writes that model's values into the same
    tensors: the earlier SharedWeights can no longer publish, and the earlier model's aliased
    parameters see the new values. Replacing parameter storage after sharing (model.to(...),
    param.data = ...) breaks the link; publish() detects it and raises.

    Raises ValueError, naming the first mismatching parameter, when the model does not fit the engine;
    nothing is changed then.
    """
    return _share(hf_model, llm, pool, alias=alias, bucket_bytes=bucket_bytes, check_logprobs=check_logprobs)


def _share(hf_model, llm, pool, *, alias: bool, bucket_bytes: int = 256 << 20, check_logprobs: bool = True,
           into: SharedWeights | None = None, checkpoint: dict | None = None) -> SharedWeights:
    """share_weights; `into`: the views to bind to `llm` instead of new ones (SharedWeights.rebind);
    `checkpoint`: from_pretrained's arguments for the meta parameters the engine cannot give back."""
    sources, engine = _validate(hf_model, llm, alias, bucket_bytes, from_checkpoint=checkpoint is not None)
    _keep_unserved(hf_model, [s for s in sources if s.placement.unserved], checkpoint, engine.device)
    sources = [s for s in sources if not s.placement.unserved]
    pool, repack = _place_engine_weights(llm, engine, pool)
    once = _write_and_alias(hf_model, sources, engine, bucket_bytes, pool, checkpoint)
    heads = _head_pairs(sources, engine)
    copies = _pairs([s for s in sources if not s.alias and not s.placement.through_loader], engine) + heads
    loaded = [s for s in sources if s.placement.through_loader]
    copied = {s.name: _why_copied(s, alias, engine) for s in sources if not s.alias}
    copied.update(_why_heads_copied(hf_model, engine))
    engine_state = dict(
        copies=_CopyPlan(copies, bucket_bytes), loads=_LoaderLoads(engine.model, hf_model, loaded),
        aliased_bytes=sum(s.param.nbytes for s in sources if s.alias),
        copy_bytes=sum(dst.nbytes for dst, _ in copies) + sum(s.param.nbytes for s in loaded), copied=copied,
        packed_bytes=sum(linear.packed_bytes for linear in repack),
        shared_once_bytes=once + sum(dst.nbytes for dst, _ in heads), repack=repack)
    if into is None:
        shared = SharedWeights(hf_model, llm, pool, alias=alias, **engine_state)
    else:
        shared = into
        shared._bind(llm, pool, **engine_state)
    previous = getattr(llm, "colo_shared_weights", None)
    if previous is not None and previous is not shared:
        previous.superseded = True
    llm.colo_shared_weights = shared
    if heads:
        _CopyPlan(heads, bucket_bytes).run(pool).synchronize()
    if once or shared._loads.count or heads:
        if shared._loads.count:
            shared._loads.run()
        for linear in repack:
            linear.repack()
    reset_prefix_cache(llm)
    if alias and copied:
        logger.warning("colo.share_weights: %d of the trainer's tensors are not views of the engine's and each "
                       "publish copies them (%d bytes): %s", len(copied), shared.copy_bytes,
                       "; ".join(f"{name} ({why})" for name, why in list(copied.items())[:4]))
    if check_logprobs:
        from .share_check import check_engine_follows, check_shared_logprobs, probe_sequences

        probe = probe_sequences(hf_model, llm)
        at_share = check_shared_logprobs(hf_model, llm, probe)
        shared.logprob_checks = {"at_share": at_share,
                                 "after_publish": check_engine_follows(shared, hf_model, llm, probe)}
        logger.info("colo.share_weights: %s; after a publish of changed weights, %s",
                    at_share.describe(), shared.logprob_checks["after_publish"].describe())
    return shared


# --- validating: the Hugging Face model against the engine (no mutation) ---------------------------

def _validate(hf_model, llm, alias: bool, bucket_bytes: int, from_checkpoint: bool = False
              ) -> tuple[list[_Source], _Engine]:
    """Everything share_weights checks before it changes anything; returns every HF parameter with its
    place in the engine, and what it read of the engine. from_checkpoint: meta parameters whose engine
    values vLLM's loader computes will be read from the model's checkpoint."""
    if not isinstance(hf_model, torch.nn.Module):
        raise TypeError(f"hf_model must be a transformers model (torch.nn.Module), not {type(hf_model).__name__}")
    check_model_config(hf_model.config)
    check_int(bucket_bytes, "bucket_bytes")
    compat.run_as_plain_modules(hf_model)
    model = compat.engine_model(llm)
    _check_config(hf_model, llm)
    placement = compat.engine_placement(llm)
    if placement is None and compat.is_compiled(llm):
        raise RuntimeError("this engine is compiled (torch.compile / CUDA graphs) and was not built by "
                           "colo.engine.build_llm: its compiled code holds weight tensors colo would have to "
                           "replace. Build it with colo.engine.build_llm, or with enforce_eager=True")
    if placement is None:
        compat.restore_emptied_weights(model)  # a foreign engine's packed CPU linears: their shapes back
    layout = compat.engine_layout(model, hf_model, kept=placement.kept if placement is not None else None)
    device = next(t.param.device for t in layout.tensors.values() if t.param.numel())
    _, _, tp_size = compat.tensor_parallel_group(llm)
    tied_heads = _tied_heads(hf_model, layout, model)
    sources = _match(hf_model, layout, alias=alias, device=device, sharded=tp_size > 1,
                     from_checkpoint=from_checkpoint, tied_heads=tied_heads)
    return sources, _Engine(placement, layout, model, device, tied_heads)


def _tied_heads(hf_model, layout: compat.EngineLayout, model) -> dict[str, str]:
    """{engine LM head: the trainer's embedding} for each LM head the engine keeps apart from its embedding
    while the trainer ties its head to its embedding (vLLM's OLMoE ignores tie_word_embeddings): no trainer
    parameter fills it, and publish() copies the embedding's rows into it."""
    output, embedding = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    if output is None or embedding is None or output.weight is not embedding.weight:
        return {}
    name = next(n for n, p in hf_model.named_parameters() if p is embedding.weight)
    rows, width = embedding.weight.shape
    return {head: name for head in compat.lm_head_names(model) & set(layout.unfilled)
            if layout.tensors[head].param.shape[1:] == (width,) and layout.tensors[head].param.shape[0] >= rows}


def _match(hf_model, layout: compat.EngineLayout, alias: bool, device: torch.device, sharded: bool,
           from_checkpoint: bool = False, tied_heads: dict[str, str] | None = None) -> list[_Source]:
    """Every HF parameter with its placement; the first that does not fit raises ValueError naming it."""
    unfilled = [name for name in layout.unfilled if name not in (tied_heads or {})]
    if unfilled:
        name = unfilled[0]
        raise ValueError(f"{name} {tuple(layout.tensors[name].param.shape)}: the engine holds it but vLLM's loader "
                         "fills it from no parameter of the trainer's model (vLLM computes a tensor of its own from "
                         "the weights after loading, or the models differ: layer count, tie_word_embeddings)")
    sources, seen = [], set()
    tower = {id(p) for p in vision_tower_parameters(hf_model)}
    for name, param in hf_model.named_parameters():
        placement = layout.placements.get(name)
        if placement is None or (placement.unserved and id(param) not in tower):
            raise no_place_for(name, param.shape)
        if placement.unserved:
            sources.append(_Source(name, param, placement, False))
            continue
        if not sharded and not placement.through_loader and \
                sum(piece.part.numel for piece in placement.pieces) != param.numel():   # vLLM's loader took part of it
            engines = sorted({piece.engine for piece in placement.pieces})
            held = (placement.view[1].shape if placement.view is not None else
                    f"{sum(piece.part.numel for piece in placement.pieces)} elements")
            raise shape_mismatch(name, param.shape, held, ", ".join(engines))
        if not param.dtype.is_floating_point:
            raise ValueError(f"{name}: dtype {param.dtype} is not a floating-point type")
        if placement.covered is not None and param.is_meta:
            raise NotImplementedError(f"{name}: the engine holds a tensor-parallel shard of it, so a meta-device "
                                      "model cannot be filled from the engine; load the trainer's model from disk "
                                      "and call colo.share_weights")
        if placement.through_loader and param.is_meta and not from_checkpoint:
            raise NotImplementedError(f"{name}: vLLM's loader computes the engine's tensors from it, so a meta-device "
                                      "model cannot be filled from the engine; load the trainer's model from disk "
                                      "and call colo.share_weights")
        if not param.is_meta and not param.is_contiguous():
            raise ValueError(f"{name}: the trainer's parameter is not contiguous; colo copies from contiguous "
                             "parameters")
        view = placement.view
        can_alias = (alias and view is not None and placement.covered is None
                     and param.dtype == layout.tensors[view[0]].dtype and (param.is_meta or param.device == device))
        seen.add(id(param))
        sources.append(_Source(name, param, placement, can_alias))
    return sources


def _check_config(hf_model, llm) -> None:
    """Same weights, different meaning: compare the model type and the fields shapes cannot reveal."""
    hf_config, engine_config = hf_model.config, compat.engine_hf_config(llm)
    if hf_config.model_type != engine_config.model_type:
        raise ValueError(f"model type: the Hugging Face model is a {hf_config.model_type} "
                         f"({type(hf_model).__name__}), the engine serves a {engine_config.model_type}")
    for key in _CONFIG_FIELDS:
        mine, theirs = _config_field(hf_config, key), _config_field(engine_config, key)
        if mine is not _MISSING and theirs is not _MISSING and mine != theirs:
            raise ValueError(f"config.{key}: {mine!r} in the Hugging Face model, {theirs!r} in the engine")


_MISSING = object()


def _config_field(config, key: str):
    """config.<key>, or _MISSING where it has none, or none for the whole model: transformers raises for a
    field that varies by layer (Gemma 4's head_dim), which the share check's log-probabilities cover."""
    try:
        return getattr(config, key, _MISSING)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError is no AttributeError
        return _MISSING


def _why_copied(source: _Source, alias: bool, engine: _Engine) -> str:
    placement = source.placement
    if not alias:
        return "alias=False"
    if placement.through_loader:
        return "vLLM's loader computes the engine's values from it"
    if placement.covered is not None:
        return "the engine holds a tensor-parallel shard of it"
    if placement.view is None:
        tensors = sorted({p.engine for p in placement.pieces})
        return f"no single view of the engine's {', '.join(tensors)} holds it as laid out"
    tensor = engine.layout.tensors[placement.view[0]]
    if source.param.dtype != tensor.dtype:
        return f"{source.param.dtype} in the trainer, {tensor.dtype} in the engine"
    return f"on {source.param.device}, the engine on {engine.device}"


# --- placing the engine's weights in a pool --------------------------------------------------------

def _place_engine_weights(llm, engine: _Engine, pool):
    """(the pool holding the engine's weights, the CPU kernels whose packed copies publish() refreshes).
    An engine colo built has them in its pool already; another one's are moved into `pool` (default:
    a new one on the engine's device)."""
    if engine.placement is not None:
        return engine.placement.pool, [linear for linear in engine.placement.linears if linear.stale_after_update]
    if any(t.param is not t.served for t in engine.layout.tensors.values()):
        raise NotImplementedError("this engine's CPU MoE kernel packed its experts at load and was not built by "
                                  "colo.engine.build_llm; build it with build_llm to share its weights")
    pool = pool if pool is not None else _foreign_engine_pool(llm, engine.device)
    _move_into_pool(pool, [t.param for t in engine.layout.tensors.values()], compat.cpu_linear_modules(engine.model))
    return pool, []


def _foreign_engine_pool(llm, device):
    from .pool import Pool

    return Pool(device)


def _move_into_pool(pool, params, linear_modules) -> None:
    """An engine colo did not build: move its parameters into the pool's weights region (one copy,
    parameter identity kept) and let its CPU linears read them through F.linear, since their packed
    copies (and, for packed layers, the weights themselves) are gone. Only for eager engines."""
    from .placement import adopt_into

    # 512 bytes a tensor: room for the padding of the region's 256-byte allocation alignment.
    region = region_for(pool, WEIGHTS, sum(shape_bytes(p.shape, p.dtype) + 512 for p in params))
    linear_weight_dtypes = {id(m.bias): m.weight.dtype for m in linear_modules if getattr(m, "bias", None) is not None}
    for param in params:
        if param.dtype != linear_weight_dtypes.get(id(param), param.dtype):
            # A bias the sgl kernel made fp32: F.linear wants the weight's dtype.
            old = param.detach()
            param.data = region.empty(tuple(old.shape), linear_weight_dtypes[id(param)])
            param.data.copy_(old)
    adopt_into(region, list(params))
    for module in linear_modules:
        module.cpu_linear = F.linear


# --- writing the trainer's values and aliasing -----------------------------------------------------

def _engine_view(engine: _Engine, placement: compat.Placement) -> torch.Tensor:
    name, view = placement.view
    return view.of(engine.layout.tensors[name].param.detach())


def _pairs(sources: list[_Source], engine: _Engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(engine elements, trainer elements) for every piece of the sources: what a copy writes."""
    pairs = []
    for s in sources:
        trainer = s.param.detach()
        for piece in s.placement.pieces:
            pairs.append((piece.view.of(engine.layout.tensors[piece.engine].param.detach()), piece.part.of(trainer)))
    return pairs


def _head_pairs(sources: list[_Source], engine: _Engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the engine LM head's rows, the trainer's embedding) for each head of engine.tied_heads."""
    embeddings = {s.name: s.param.detach() for s in sources}
    pairs = []
    for head, embedding in engine.tied_heads.items():
        values = embeddings[embedding]
        pairs.append((engine.layout.tensors[head].param.detach()[:values.shape[0]], values))
    return pairs


def _why_heads_copied(hf_model, engine: _Engine) -> dict[str, str]:
    """{the trainer's head: why} for the tied heads the engine keeps apart (named as state_dict names it)."""
    output = hf_model.get_output_embeddings()
    name = next((n for n, p in hf_model.named_parameters(remove_duplicate=False)
                 if p is getattr(output, "weight", None) and n not in engine.tied_heads.values()), None)
    return {name or head: f"the trainer ties it to {embedding}; vLLM's {type(engine.model).__name__} keeps an LM "
            f"head of its own ({head}), filled from it" for head, embedding in engine.tied_heads.items()}


def _write_and_alias(hf_model, sources: list[_Source], engine: _Engine, bucket_bytes: int, pool,
                     checkpoint: dict | None = None) -> int:
    """Write the trainer's values into the engine (skipped for meta parameters and for views of the
    engine already), then make aliased parameters views; returns the bytes written. Meta parameters
    the engine cannot give back take their values from `checkpoint` (from_pretrained's arguments)."""
    written = 0
    replaced = {}  # id(meta parameter) -> the Parameter that replaces it
    unreadable = [s for s in sources if s.param.is_meta and s.placement.through_loader]
    saved = _checkpoint_values(hf_model, unreadable, checkpoint, engine.device) if unreadable else {}
    with torch.no_grad():
        for s in sources:
            if s.param.is_meta:
                value = saved.get(s.name)
                if value is None:
                    value = _engine_view(engine, s.placement) if s.alias else _gather(s, engine)
                replaced[id(s.param)] = torch.nn.Parameter(value, requires_grad=s.param.requires_grad)
            elif s.alias:
                view = _engine_view(engine, s.placement)
                if s.param.data_ptr() != view.data_ptr() or s.param.stride() != view.stride():
                    view.copy_(s.param)
                    written += view.nbytes
        unwritten = [s for s in sources if not s.alias and not s.param.is_meta and not s.placement.through_loader]
        if unwritten:
            _CopyPlan(_pairs(unwritten, engine), bucket_bytes).run(pool).synchronize()
            written += sum(s.param.nbytes for s in unwritten)
        written += sum(s.param.nbytes for s in sources if s.placement.through_loader)
    for s in sources:
        if s.alias and not s.param.is_meta:
            s.param.data = _engine_view(engine, s.placement)
    if replaced:
        _replace_parameters(hf_model, replaced)
        for s in sources:
            s.param = replaced.get(id(s.param), s.param)
    _share_buffers(hf_model, engine)
    materialize_buffers(hf_model, engine.device)
    return written


def _share_buffers(hf_model, engine: _Engine) -> None:
    """The buffers vLLM loads as weights (a DeepSeek-V3 or GLM-4.5 router's `e_score_correction_bias`)
    become views of the engine's tensors, the trainer's values written in first (a meta model's are the
    engine's). Not trained: nothing to publish; in another dtype, the trainer keeps a cast copy."""
    for name, buffer in compat.persistent_buffers(hf_model).items():
        placement = engine.layout.placements.get(name)
        if placement is None:
            continue   # vLLM's loader skips it: the trainer keeps its own
        if placement.view is None or placement.covered is not None:
            raise NotImplementedError(f"{name}: a buffer the engine holds other than as one view of one tensor; "
                                      "colo shares buffers as views only")
        view = _engine_view(engine, placement)
        with torch.no_grad():
            if not buffer.is_meta:
                view.copy_(buffer)
        module_name, _, attr = name.rpartition(".")
        module = hf_model.get_submodule(module_name)
        module._buffers[attr] = view if view.dtype == buffer.dtype else view.to(buffer.dtype)


def _keep_unserved(hf_model, unserved: list[_Source], checkpoint: dict | None, device: torch.device) -> None:
    """The vision tower's parameters vLLM does not build (the layers after the one a LLaVA reads its image
    features from, which the trainer's forward computes and does not use either): the trainer keeps
    them, frozen, with the checkpoint's values, saved with the model and never published."""
    if not unserved:
        return
    meta = [s for s in unserved if s.param.is_meta]
    if meta and checkpoint is None:
        raise NotImplementedError(f"{meta[0].name}: the engine does not keep it, so a meta-device model cannot be "
                                  "filled from the engine; load the trainer's model from disk and call colo.share_weights")
    model_dir = Path(checkpoint["pretrained_model_name_or_path"]) if meta else None
    if meta and model_dir.is_dir():
        saved = read_checkpoint_tensors(model_dir, [n for s in meta for n in s.placement.checkpoint_names])
        values = {s.name: saved[s.placement.checkpoint_names[0]] for s in meta
                  if len(s.placement.checkpoint_names) == 1 and s.placement.checkpoint_names[0] in saved}
    else:
        values = {}
    missing = [s for s in meta if s.name not in values]
    if missing:
        values.update(_checkpoint_values(hf_model, missing, checkpoint, device))
    replaced = {id(s.param): torch.nn.Parameter(values[s.name].to(device=device, dtype=s.param.dtype),
                                                requires_grad=False) for s in meta}
    if replaced:
        _replace_parameters(hf_model, replaced)
    for s in unserved:
        if not s.param.is_meta:
            s.param.requires_grad_(False)
    logger.info("colo.share_weights: %d vision-tower tensors the engine does not build stay the trainer's, frozen "
                "(%s)", len(unserved), ", ".join(s.name for s in unserved[:3]))


def _checkpoint_values(hf_model, sources: list[_Source], checkpoint: dict, device: torch.device) -> dict:
    """{name: the saved values of each source's parameter}, in its dtype on `device`: the trainer's model
    loaded once from the checkpoint on the host (transformers maps the saved names to its own), then
    dropped."""
    with compat.building_trainer_models():
        loaded = trainer_auto_class(hf_model.config).from_pretrained(**checkpoint, dtype=sources[0].param.dtype)
    params = dict(loaded.named_parameters())
    return {s.name: params[s.name].detach().to(device=device, dtype=s.param.dtype) for s in sources}


def _gather(source: _Source, engine: _Engine) -> torch.Tensor:
    """A trainer tensor of its own holding the engine's values of `source` (a meta parameter that cannot
    be a view), in the trainer's dtype."""
    value = torch.empty(source.placement.hf_shape, dtype=source.param.dtype, device=engine.device)
    for piece in source.placement.pieces:
        piece.part.of(value).copy_(piece.view.of(engine.layout.tensors[piece.engine].param.detach()))
    return value


def _replace_parameters(module: torch.nn.Module, replaced: dict) -> None:
    """Swap Parameter objects everywhere they are registered (a tied one in two modules)."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and id(param) in replaced:
                sub._parameters[name] = replaced[id(param)]


class _LoaderLoads:
    """Parameters whose engine values vLLM's loader computes: publish() hands them to the engine's own
    `load_weights` in the checkpoint's names and layout (what TRL does for every parameter)."""

    def __init__(self, model, hf_model, sources: list[_Source]):
        self.model, self.hf_model, self.sources = model, hf_model, sources
        self.count = len(sources)

    def run(self) -> None:
        names = {s.name for s in self.sources}
        wanted = {n for s in self.sources for n in s.placement.checkpoint_names}
        with torch.no_grad():
            params = {s.name: s.param.detach() for s in self.sources}
            checkpoint = compat.checkpoint_tensors(self.hf_model, params) if names else {}
            self.model.load_weights((n, t) for n, t in checkpoint.items() if n in wanted)


class _CopyPlan:
    """Copies from trainer tensors into engine pieces, grouped once so that running them is a few
    calls: same-dtype contiguous pairs as one batch of byte copies, the rest (casts, strided
    pieces) as `torch._foreach_copy_` buckets of about `bucket_bytes`."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], bucket_bytes: int):
        self.byte_pairs, self.cast_buckets = [], []
        dsts, srcs, size = [], [], 0
        for dst, src in pairs:
            if src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous() and src.device == dst.device:
                self.byte_pairs.append((dst, src))
                continue
            dsts.append(dst)
            srcs.append(src)
            size += dst.nbytes
            if size >= bucket_bytes:
                self.cast_buckets.append((dsts, srcs))
                dsts, srcs, size = [], [], 0
        if dsts:
            self.cast_buckets.append((dsts, srcs))
        self.count = len(self.byte_pairs) + sum(len(d) for d, _ in self.cast_buckets)
        self.batches = int(bool(self.byte_pairs)) + len(self.cast_buckets)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every (engine piece, trainer tensor) this plan copies."""
        return self.byte_pairs + [pair for dsts, srcs in self.cast_buckets for pair in zip(dsts, srcs)]

    def run(self, pool, after=None):
        """Enqueue the copies on the pool's copy stream (after event `after`); returns the copy stream's event."""
        copy_stream = pool.stream("copy")
        if after is not None:
            copy_stream.wait(after)
        elif pool.device.type == "cuda":  # the trainer's tensors were written on torch's stream
            copy_stream.torch_stream().wait_stream(torch.cuda.current_stream(pool.device))
        if self.byte_pairs:
            copy_stream.copy_async(self.byte_pairs)
        if self.cast_buckets:
            if pool.device.type != "cuda" and after is not None:
                after.synchronize()  # host: the casts run in this thread, so wait for training's work here
            with _torch_stream(copy_stream):
                for dsts, srcs in self.cast_buckets:
                    torch._foreach_copy_(dsts, srcs)
        return copy_stream.record()


@contextlib.contextmanager
def _torch_stream(stream):
    if stream.pool.device.type == "cuda":
        with torch.cuda.stream(stream.torch_stream()):
            yield
    else:
        yield
