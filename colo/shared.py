"""The engine-view contract: a trainer model whose tensors are the in-process engine's.

Three kinds implement it: `colo.weights.SharedWeights` (the whole model, one copy),
`colo.tensor_parallel.TensorParallelModel` (this rank's shards) and `colo.lora.SharedAdapter` (an
adapter in the engine's LoRA slot). Whoever trains (colo.grpo's scheduler, its checkpointer, colo.trl)
holds one `EngineViews` and never asks which kind it is:

    views.parameters()                  what the optimizer steps
    views.publish() -> PublishReport    the engine serves what the optimizer wrote
    views.full_state_dict(values=None)  the whole weights (or adapter): Hugging Face names and shapes,
                                        gathered on the first rank of a tensor-parallel group
    views.load_full_state_dict(state)   whole tensors into this rank's views, every name and shape checked first
    views.trainer_model                 what forward runs on (colo.grpo.batch.completion_logprobs takes it)
    views.grad_norm(params, grads)      the whole model's gradient norm (shards summed, replicas once)
    views.detach(); views.rebind(llm)   a broken engine replaced: the same parameters (an optimizer holds
                                        them) with their values, then views of the new engine's tensors

As in RMM's resources, these public methods are written once, here; a kind implements only the hooks
where it differs (`_publish_copies`, `_check_served`, `grad_norm`, ...). Its state is declared here
once, and `watch()` is the only way it comes in: the layout ({Hugging Face name: `Placed`}) says
which parameter holds each whole tensor, or which part of it on this rank, and the addresses are
remembered so that a parameter given new storage (model.to(), .half(), assigning .data), which no
longer reaches the engine, makes publish() refuse rather than serve stale weights.

The helpers all kinds build with are here too: what colo trains (`check_model_config`: a decoder-only
causal LM of a family transformers builds; whether its weights can be shared is the engine's layout's to
say, colo.vllm_compat.engine_layout, not a list of names), the Hugging Face model built on the meta
device, the errors for a model that does not fit the engine (one wording for every kind), and gathering
a tensor-parallel tensor whole.
"""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .hf_names import checkpoint_keys, keep_checkpoint_names
from .model_classes import is_vision_language, trainer_auto_class, trainer_class_name  # noqa: F401

WHAT_COLO_TRAINS = ("colo trains decoder-only language models that transformers and vLLM both implement "
                    "(dense or MoE, text or vision-language)")


@dataclass(frozen=True)
class PublishReport(Mapping):
    """What one publish() did. Reads as a dict too (report["bytes_copied"], dict(report)), as before."""
    bytes_copied: int = 0        # bytes copied or cast into the engine (0 when every tensor is a view)
    bytes_repacked: int = 0      # CPU: bytes repacked into vLLM's kernel layouts
    seconds: float = 0.0
    aliased_bytes: int = 0       # trainer bytes that are the engine's (never copied)
    copied_tensors: int = 0
    buckets: int = 0             # copy batches on the copy stream
    adapter_bytes: int = 0       # LoRA: the adapter's bytes in the engine's slot

    def __getitem__(self, key: str):
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class Placed:
    """Where one whole Hugging Face tensor lives on this rank: `param` holds all of it (ranges None) or
    the part ranges[rank] along `dim`: ranges lists, in rank order, each rank's (start, stop) segments,
    which its part holds one after another (one segment mostly; a fused MoE `gate_up_proj` holds its
    gate rows, then its up rows)."""
    param: torch.nn.Parameter
    shape: tuple[int, ...]                       # the whole tensor's
    dim: int = 0
    ranges: tuple[tuple[tuple[int, int], ...], ...] | None = None


class EngineViews:
    """The base of every kind; see the module docstring. A kind calls `watch()` once its parameters
    are views of the engine's tensors (and again after re-pointing them at a rebuilt engine).

    llm: the engine; hf_model: the Hugging Face module the trainer runs; shared_by: the call that
    made them (named in errors); repack: CPU linears whose packed copy the trainer's updates make stale
    (colo.vllm_compat.CpuLinear); group, rank: the tensor-parallel group and this rank in it (None, 0:
    no tensor parallelism); logprob_checks: what colo.share_check measured when the views were made
    ({"at_share": LogprobGap, "after_publish": LogprobGap}; {} where a kind is not checked)."""

    copy_bytes: int = 0   # bytes each publish() copies into the engine (0: every tensor is a view); a kind's own

    def __init__(self, llm, hf_model, *, shared_by: str, repack=(), group=None, rank: int = 0):
        self.llm, self.hf_model, self.shared_by = llm, hf_model, shared_by
        self.group, self.rank = group, rank
        self.publish_count = 0
        self.logprob_checks: dict = {}
        self._repack = list(repack)
        self.layout: dict[str, Placed] = {}
        self._storage: dict[int, torch.Tensor] = {}   # id(parameter) -> its storage when watched

    def watch(self, layout: dict[str, Placed]) -> None:
        """Take `layout` as this view's parameters, and remember their storage now (the engine's tensors,
        or the trainer's own where a parameter is copied)."""
        self.layout = dict(layout)
        self._storage = {id(p.param): p.param.data for p in self.layout.values()}

    # -- the contract: the same for every kind -----------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters, each once (a tied head is the embedding's), in layout order."""
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        seen, named = set(), []
        for name, placed in self.layout.items():
            if id(placed.param) not in seen and placed.param.requires_grad:
                seen.add(id(placed.param))
                named.append((name, placed.param))
        return named

    def moved_parameters(self) -> list[str]:
        """Names of the parameters given new storage since they were shared: the engine no longer sees them."""
        return [name for name, placed in self.layout.items()
                if placed.param.data_ptr() != self._storage[id(placed.param)].data_ptr()]

    @property
    def weights(self) -> "EngineViews":
        """The views of the model's own weights: these (an adapter's: those of the frozen base it is on)."""
        return self

    @torch.no_grad()
    def reshare(self) -> int:
        """Put the parameters given new storage since they were shared (moved_parameters: accelerate's
        .to("cpu:N") copies every one) back into the storage they were shared in, with their current
        values, so the engine sees them again (an adapter's base too); returns the bytes written."""
        written, done = 0, set()
        for placed in self.layout.values():
            param, home = placed.param, self._storage[id(placed.param)]
            if id(param) not in done and param.data_ptr() != home.data_ptr():
                home.copy_(param.data)
                param.data = home
                written += home.nbytes
            done.add(id(param))
        beneath = self.weights
        return written + (beneath.reshare() if beneath is not None and beneath is not self else 0)

    def publish(self) -> PublishReport:
        """Make the engine serve what the optimizer wrote: what cannot alias is copied (the kind's
        `_publish_copies`), CPU kernels' packed copies are refreshed in place, vLLM's prefix cache (KV of
        the old weights) is forgotten, and the publish is counted."""
        from .engine import reset_prefix_cache

        started = time.perf_counter()
        self._check_served()
        moved = self.moved_parameters()
        if moved:
            raise RuntimeError(f"{moved[0]} was given new storage after {self.shared_by} (e.g. model.to(), .half(), "
                               f"or assigning param.data); the engine no longer sees it. Call {self.shared_by} again.")
        report = self._publish_copies()
        repacked = sum(linear.repack() for linear in self._repack)
        reset_prefix_cache(self.llm)
        self.publish_count += 1
        return PublishReport(bytes_repacked=repacked, seconds=time.perf_counter() - started, **report)

    def full_state_dict(self, values: dict | None = None) -> dict[str, torch.Tensor] | None:
        """{Hugging Face name: the whole tensor} (what save_pretrained or a checkpoint holds), on the
        first rank of a tensor-parallel group, None on the others (a collective there). Tensors this rank
        holds whole are returned as they are, not copied; a tied head is the embedding's tensor.
        values: {parameter: tensor to give instead}, e.g. fp32 masters. Whole weights hold the buffers
        the model saves with them too (a router's score correction: _saved_buffers)."""
        first = self.rank == 0
        state, done = ({} if first else None), {}
        for name, placed in self.layout.items():
            if id(placed.param) not in done:
                local = (values or {}).get(placed.param, placed.param).detach()
                if placed.ranges is None:
                    done[id(placed.param)] = local if first else None
                else:
                    done[id(placed.param)] = gather_whole(local, placed, self.group, first)
            if first:
                state[name] = done[id(placed.param)]
        if first:
            state.update((name, buffer.detach()) for name, buffer in self._saved_buffers().items())
        return state

    def _saved_buffers(self) -> dict:
        """{name: buffer} of the buffers full_state_dict holds beside the tensors: none by default (an
        adapter's state is the adapter; the tensor-parallel trainer refuses such buffers)."""
        return {}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Write whole tensors (full_state_dict's names and shapes, from a run of any tensor-parallel
        size) into this rank's views, in place; everything is checked before anything is written. The
        engine serves them after publish(); optimizer masters are the caller's to refresh."""
        given = {id(self.layout[name].param) for name in state if name in self.layout}
        # A tied head is the embedding's parameter: a state that names only one of them (as
        # save_pretrained writes a tied model) holds it all the same.
        missing = [name for name, placed in self.layout.items() if name not in state and id(placed.param) not in given]
        buffers = self._saved_buffers()
        unexpected = [name for name in state if name not in self.layout and name not in buffers]
        if missing or unexpected:
            raise ValueError(f"the state is not one of this model: missing {missing[:3]}, unexpected {unexpected[:3]} "
                             f"(it must hold every tensor of {self.shared_by}'s model, whole)")
        present = [(name, placed) for name, placed in self.layout.items() if name in state]
        for name, placed in present:
            if tuple(state[name].shape) != tuple(placed.shape):
                raise ValueError(f"{name}: the state's is {tuple(state[name].shape)}, this model's is {tuple(placed.shape)}")
        for name, placed in present:
            placed.param.copy_(rank_part(state[name], placed, self.rank))
        for name, buffer in buffers.items():
            if name in state:
                buffer.copy_(state[name])

    # -- what the trainer needs, with defaults for a model held whole on this rank -----------------
    @property
    def trainer_model(self):
        """What forward runs on: a Hugging Face model, or an object with completion_logprobs()
        (colo.grpo.batch.completion_logprobs takes either)."""
        return self.hf_model

    def scales(self) -> dict | None:
        """{parameter: engine units per optimizer unit} where the two differ (a LoRA B in vLLM's slot);
        None: the optimizer steps what the engine holds."""
        return None

    def grad_norm(self, params: list, grads: list) -> float:
        """The L2 norm of the whole model's gradient, `grads[i]` being params[i]'s."""
        if not grads:
            return 0.0
        norms = torch._foreach_norm([g.detach() for g in grads])
        return float(torch.linalg.vector_norm(torch.stack([n.double() for n in norms])))

    def norm_weights(self, params: list) -> dict[int, float]:
        """{index in params: w} such that summing w x each squared gradient over the group's ranks gives
        the whole model's (for colo.ShardedMasterWeightOptimizer.clip_grad_norm_); {}: every weight 1."""
        return {}

    @property
    def collective_count(self) -> int:
        """Collectives this view has issued so far (forward and backward): 0 without tensor parallelism."""
        return 0

    def reference(self) -> "Reference":
        """The frozen policy a KL term compares with, at the cheapest: here a frozen copy of the model."""
        reference = copy.deepcopy(self.hf_model).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
        return FrozenCopy(reference)

    def master_names(self) -> list[str] | None:
        """The names of the parameters in optimizer order, where the optimizer's fp32 masters of them are
        whole tensors a saved model may be written from (None: they are not, and the model is saved as
        served)."""
        return [name for name, _ in self.named_parameters()]

    def write_pretrained(self, directory, state: dict, *, base_dir, dtype=None, masters: dict | None = None,
                         merge: bool = False):
        """A Hugging Face model directory of full_state_dict() `state`, each weight replaced by its fp32
        master where `masters` has one, in `dtype` (colo.hf_format)."""
        from .hf_format import weights_to_save, write_model

        return write_model(weights_to_save(state, masters), base_dir, directory, dtype)

    @torch.no_grad()
    def detach(self) -> None:
        """Before a broken engine is released: the parameters get private copies of their values and
        these views let go of the engine, so its tensors and KV cache can be freed; rebind() then makes
        the same parameters views of a new engine's tensors."""
        for param in {id(p.param): p.param for p in self.layout.values()}.values():
            param.data = param.data.clone()
        self.llm, self._repack, self._storage = None, [], {}
        self._detach_kind()

    def rebind(self, llm) -> None:
        """The same parameters (an optimizer holds them), with the values they have, now views of `llm`'s
        tensors (an engine built with placeholder weights after detach())."""
        raise NotImplementedError(f"{type(self).__name__} views cannot move to a new engine")

    # -- hooks of the kinds ------------------------------------------------------------------------
    def _detach_kind(self) -> None:
        """What else of the engine this kind holds, dropped (detach())."""

    def _check_served(self) -> None:
        """Raise if the engine no longer serves these views (before anything is published)."""

    def save_beside_checkpoint(self, out_dir, *, base_model: str, full: dict | None = None) -> None:
        """Files this kind writes beside each checkpoint in `out_dir` (whole weights: none; the LoRA kind:
        the newest adapter in PEFT's format). `full`: the full_state_dict the checkpoint holds."""

    def load_trainer_checkpoint(self, directory, masters: dict | None = None) -> bool:
        """Restore the trained values from a Hugging Face Trainer checkpoint `directory` into these views
        (and `masters`, {parameter: fp32 tensor}) where this kind must do it itself; False where the
        Trainer's own loading does it in place (whole weights: their parameters are the views)."""
        return False

    def _publish_copies(self) -> dict:
        """Order the trainer's work before the engine's and copy what does not alias; returns the
        PublishReport fields it sets (aliased_bytes at least)."""
        raise NotImplementedError


# -- helpers the kinds share ----------------------------------------------------------------------

class Reference:
    """The KL term's reference policy, as views.reference() gives it: forward runs on `model()`'s
    Hugging Face model inside its block; state_dict() is what a checkpoint keeps of it (None: nothing
    of its own), load_state_dict() restores that."""

    def model(self):
        """A context manager whose value is the Hugging Face model the reference runs as."""
        raise NotImplementedError

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass

    def sync(self, policy, alpha: float) -> None:
        """TRL's sync_ref_model (TR-DPO): the reference moves towards the policy, ref = (1 - alpha) ref +
        alpha policy; only a reference of its own can."""
        raise NotImplementedError(f"{type(self).__name__}: this reference has no weights of its own to move "
                                  "(sync_ref_model needs full fine-tuning, as in TRL)")


class FrozenCopy(Reference):
    """A reference of its own: a frozen copy of the model, as it was when copied (its memory is a
    second copy of the weights; a checkpoint keeps it)."""

    def __init__(self, hf_model):
        self.hf_model = hf_model

    @contextlib.contextmanager
    def model(self):
        yield self.hf_model

    def state_dict(self) -> dict:
        return self.hf_model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.hf_model.load_state_dict(state)

    @torch.no_grad()
    def sync(self, policy, alpha: float) -> None:
        for mine, theirs in zip(self.hf_model.parameters(), policy.parameters(), strict=True):
            mine.mul_(1.0 - alpha).add_(theirs.to(mine.dtype), alpha=alpha)


def check_model_config(config) -> None:
    """Refuse, naming why, a config colo cannot train, before any engine starts: an encoder-decoder
    model, one transformers has neither a causal LM nor an image-text-to-text class for (an encoder), or
    one whose `architectures` disagree with its `model_type`."""
    import transformers

    model_type = getattr(config, "model_type", None)
    architectures = list(getattr(config, "architectures", None) or ())
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{model_type} is an encoder-decoder model; {WHAT_COLO_TRAINS}")
    expected = trainer_class_name(config)
    if expected is None:
        raise NotImplementedError(f"transformers has no causal LM or image-text-to-text model for model_type "
                                  f"{model_type!r} (an encoder, or not a language model); {WHAT_COLO_TRAINS}")
    for arch in architectures:
        if arch == expected:
            continue
        cls = getattr(transformers, arch, None)
        config_class = getattr(cls, "config_class", None)
        if config_class is None or config_class.model_type != model_type:
            raise ValueError(f"config.architectures names {arch}, but model_type {model_type!r} is "
                             f"{expected}: the config contradicts itself")
        if not arch.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
            raise NotImplementedError(f"{arch} is not a causal language model (an encoder, or a model with another "
                                      f"head); {WHAT_COLO_TRAINS}")


def meta_model(config, dtype: torch.dtype, checkpoint: str | None = None):
    """The Hugging Face model of `config` on the meta device (no memory), whose parameters are then
    pointed at engine tensors: a causal LM, or an image-text-to-text model for a vision-language one.
    checkpoint: the model directory the engine loaded, whose weight names the model keeps for saving
    and for vLLM's loader (colo.hf_names; a hub name keeps transformers' defaults)."""
    from .vllm_compat.trainer_models import building_trainer_models

    check_model_config(config)
    with torch.device("meta"), building_trainer_models():
        model = trainer_auto_class(config).from_config(config, dtype=dtype)
    keys = checkpoint_keys(checkpoint) if checkpoint is not None and Path(checkpoint).is_dir() else []
    if keys:
        keep_checkpoint_names(model, keys)
    return model


def no_parameter_for(name: str, engine_tensor: str, shape) -> ValueError:
    return ValueError(f"{name}: the engine has {engine_tensor} {tuple(shape)} but the Hugging Face model has no such "
                      "parameter")


def no_place_for(name: str, shape) -> ValueError:
    return ValueError(f"{name}: the Hugging Face model has this parameter {tuple(shape)} but the engine has no place "
                      "for it (different architecture, layer count or tie_word_embeddings?)")


def shape_mismatch(name: str, model_shape, engine_shape, engine_tensor: str) -> ValueError:
    held = tuple(engine_shape) if isinstance(engine_shape, (tuple, list, torch.Size)) else engine_shape
    return ValueError(f"{name}: shape {tuple(model_shape)} in the Hugging Face model, the engine expects "
                      f"{held} (for {engine_tensor})")


def rank_part(whole: torch.Tensor, placed: Placed, rank: int) -> torch.Tensor:
    """This rank's part of a whole tensor placed as `placed` says (the whole where it is not split)."""
    if placed.ranges is None:
        return whole
    parts = [whole.narrow(placed.dim, start, stop - start) for start, stop in placed.ranges[rank]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, placed.dim)


def gather_whole(local: torch.Tensor, placed: Placed, group, first: bool) -> torch.Tensor | None:
    """The whole tensor whose part ranges[r] rank r of `group` holds (`local` here), on the group's first
    rank; None on the others (a collective: torch.distributed.gather takes equal shapes, so each part is
    padded along `dim` to the longest)."""
    import torch.distributed as dist

    dim, ranges = placed.dim, placed.ranges
    lengths = [sum(stop - start for start, stop in segments) for segments in ranges]
    longest = max(lengths)
    padded = local
    if local.shape[dim] < longest:
        shape = list(local.shape)
        shape[dim] = longest - local.shape[dim]
        padded = torch.cat([local, local.new_zeros(shape)], dim)
    padded = padded.contiguous()
    pieces = [torch.empty_like(padded) for _ in ranges] if first else None
    dist.gather(padded, pieces, dst=dist.get_global_rank(group, 0), group=group)
    if not first:
        return None
    whole = local.new_empty(placed.shape)
    for segments, piece in zip(ranges, pieces):
        offset = 0
        for start, stop in segments:
            whole.narrow(dim, start, stop - start).copy_(piece.narrow(dim, offset, stop - start))
            offset += stop - start
    return whole


def materialize_buffers(hf_model, device) -> None:
    """A meta-device model's buffers (rotary frequencies, an embedding's scale) computed for real, by the
    model's own initialisation, as transformers does when it loads a checkpoint onto the meta device;
    the parameters are marked initialised first, so nothing else is touched. Each module is initialised
    by the innermost transformers model holding it (a LLaVA's CLIP tower computes its own position ids)."""
    owners = _initialising_models(hf_model)
    modules = [m for m in hf_model.modules() if any(b is not None and b.is_meta for b in m._buffers.values())]
    if not modules:
        return
    for param in hf_model.parameters():
        param._is_hf_initialized = True
    for module in modules:
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
        owners[id(module)]._init_weights(module)


def _initialising_models(hf_model) -> dict:
    """{id(module): the innermost transformers PreTrainedModel holding it (itself if it is one)}."""
    from transformers import PreTrainedModel

    owners = {}

    def walk(module, owner):
        owner = module if isinstance(module, PreTrainedModel) else owner
        owners[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(hf_model, hf_model)
    return owners
