"""Tensor parallelism with one copy: each rank's trainer holds only its shards of the weights, and
they are views of its own vLLM engine's tensor-parallel shards.

    # under torchrun, on every rank (vLLM's external_launcher: one engine shard per process)
    import colo, colo.engine, colo.tensor_parallel
    llm = colo.engine.build_llm(path, pool, tensor_parallel_size=2)
    tp = colo.tensor_parallel.shared_tp_model(llm)          # this rank's shards: views of the engine's
    logp = tp.token_logprobs(input_ids)                     # vocabulary-parallel: no full logits
    opt = colo.MasterWeightOptimizer(tp.parameters(), lr=1e-5)
    (-logp.mean()).backward(); tp.clip_grad_norm_(opt, 1.0); opt.step(); opt.zero_grad()
    tp.publish()                                            # 0 bytes: the engine reads what opt wrote
    whole = tp.full_state_dict({p: m for p, m in zip(opt.params, opt.masters)})  # rank 0: HF names, shapes
    tp.load_full_state_dict(state)                          # whole weights (any TP size's) into this rank's shards

vLLM's layout on tensor-parallel rank r of T (model_executor/layers/linear.py and
vocab_parallel_embedding.py): `QKVParallelLinear` holds [q rows of its heads | k rows | v rows],
`MergedColumnParallelLinear` [gate rows r I/T .. | up rows ..], `RowParallelLinear` the input columns
[r in/T, (r+1) in/T), `VocabParallelEmbedding` / `ParallelLMHead` a range of the vocabulary (padded
to a multiple of 64, padding at the tail), norms whole. A Hugging Face model built from the config
with heads / T, KV heads / T and intermediate / T has exactly these shapes, so each of its parameters
is a view of one engine tensor (`colo.vllm_compat.engine_layout` says which, read from vLLM's loader). Megatron's
collectives make it compute the whole model: the attention's and the MLP's inputs pass through
`copy_to_group` (identity forward, all-reduce of the gradient backward), the o_proj's and the MLP's
outputs through `reduce_from_group` (all-reduce forward, identity backward): 2 all-reduces per layer
forward and 2 backward. A MoE layer is split the same way (vLLM splits every expert's width over the
ranks, as a dense MLP's): each rank's `gate_up_proj` is its gate rows then its up rows of every expert,
its `down_proj` the matching columns, the router whole on every rank. What every rank holds whole inside
the split attention or MLP (the router, a shared expert's gate, Qwen3's per-head q/k norms) gets from each
rank the part of its gradient that rank's heads or experts give, summed over the ranks. The embedding is vocabulary-parallel (one all-reduce), and log-probabilities
are computed over the vocabulary shards (the max, the sum of exponentials and the target's logit
all-reduced; the full logits are never gathered).

Sharded parameters get complete gradients on their rank. Replicated ones (the norms) get the same
gradient on every rank, since their inputs and their outputs' gradients are whole there, and the
gradient norm counts them once. With fewer KV heads than ranks, vLLM gives each rank one KV head,
shared by size / kv_heads consecutive ranks whose query heads use it: each of those ranks computes part
of its k_proj / v_proj gradient, summed over them by one all-reduce per parameter as autograd
produces it (before any optimizer's hook sees it), and counted once in the norm. A LoRA adapter
(colo.lora.share_adapter with tp=) trains on top of the shards; its pieces that several ranks hold
the same join them through `add_replicated`. Refused with NotImplementedError before anything
changes: biases of row-parallel layers (vLLM adds them on rank 0 only), and a parameter whose shard is
not one view of an engine tensor (the layout says which).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import vllm_compat as compat
from .clipping import clip_
from .shared import EngineViews, Placed, materialize_buffers, meta_model, no_parameter_for, no_place_for, shape_mismatch


ROW_PARALLEL_BIASES = ("o_proj.bias", "down_proj.bias")
KV_PARAMETERS = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")


@dataclass
class Collectives:
    """All-reduces issued by a tensor-parallel model, forward and backward (for the step's count)."""
    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (the input feeds every rank's shard)."""

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.group, ctx.counts = group, counts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        ctx.counts.backward += 1
        return grad, None, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum over the group forward (each rank holds a partial sum); identity backward."""

    @staticmethod
    def forward(ctx, x, group, counts):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        counts.forward += 1
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class VocabParallelEmbedding(torch.nn.Module):
    """This rank's rows [start, start + rows) of the vocabulary; other tokens read zeros, and the
    ranks' results are summed."""

    def __init__(self, weight: torch.nn.Parameter, start: int, group, counts: Collectives):
        super().__init__()
        self.weight, self.start, self.group, self.counts = weight, start, group, counts

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return _ReduceFromGroup.apply(out, self.group, self.counts)


def vocab_parallel_logprobs(local_logits: torch.Tensor, targets: torch.Tensor, start: int, group,
                            counts: Collectives) -> torch.Tensor:
    """log softmax(logits)[target] in fp32 from this rank's vocabulary columns [start, start + n)."""
    local = local_logits.float()
    with torch.no_grad():
        peak = local.max(-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        counts.forward += 1
    shifted = local - peak.unsqueeze(-1)
    sum_exp = _ReduceFromGroup.apply(shifted.exp().sum(-1), group, counts)
    index = targets - start
    inside = (index >= 0) & (index < local.shape[-1])
    picked = shifted.gather(-1, index.clamp(0, local.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * inside
    return _ReduceFromGroup.apply(picked, group, counts) - sum_exp.log()


class TensorParallelModel(EngineViews):
    """This rank's trainer model (see the module docstring); `hf_model` returns this rank's
    vocabulary columns of the logits, `token_logprobs` the log-probabilities of whole-vocabulary
    softmaxes. Its layout places each Hugging Face tensor's shard: full_state_dict() gathers the whole
    weights on the group's first rank, load_full_state_dict() writes each rank's part (colo.shared)."""

    def __init__(self, hf_model, llm, *, group, rank: int, size: int, vocab_start: int, layout: dict, replicated: list,
                 kv_replicas: int = 1, kv_params=(), kv_group=None, collectives: Collectives, repack=()):
        super().__init__(llm, hf_model, shared_by="colo.tensor_parallel.shared_tp_model", repack=repack, group=group,
                         rank=rank)
        self.size = size
        self.vocab_start = vocab_start                 # the first vocabulary row this rank holds
        self.replicated = list(replicated)             # parameters every rank holds whole (norms)
        self.kv_replicas = kv_replicas                 # ranks sharing one KV head (1: KV heads split over the ranks)
        self.kv_params = list(kv_params)               # k_proj / v_proj parameters, when kv_replicas > 1
        self.kv_group = kv_group                       # the ranks sharing this rank's KV head, when kv_replicas > 1
        self.collectives = collectives
        self.watch(layout)

    @property
    def trainer_model(self):
        return self  # completion_logprobs over the vocabulary shards

    @property
    def collective_count(self) -> int:
        return self.collectives.total

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """log p(input_ids[:, t + 1] | input_ids[:, :t + 1]), fp32, [batch, length - 1]."""
        logits = self.hf_model(input_ids=input_ids, attention_mask=attention_mask).logits
        return vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], self.vocab_start, self.group,
                                       self.collectives)

    def completion_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, *, attention_mask=None,
                            position_ids=None, temperature: float = 1.0) -> torch.Tensor:
        """log p(targets) under softmax(logits / temperature), fp32, for the last targets.shape[1]
        positions of `input_ids` (colo.grpo's completion columns): the logits of the
        targets.shape[1] positions before each target, over the vocabulary shards."""
        keep = targets.shape[1]
        logits = self.hf_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               logits_to_keep=keep + 1, use_cache=False).logits[:, :-1]
        if temperature != 1.0:
            logits = logits.float() / temperature
        return vocab_parallel_logprobs(logits, targets, self.vocab_start, self.group, self.collectives)

    def grad_norm(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
        """The L2 norm of the whole model's gradient: shards summed over the ranks, replicated
        parameters once."""
        weights = self.norm_weights(params)
        squares = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        for i, g in enumerate(grads):
            squares += weights.get(i, 1.0) * g.double().square().sum()
        dist.all_reduce(squares, group=self.group)
        return float(squares.sqrt())

    def norm_weights(self, params: list[torch.Tensor]) -> dict[int, float]:
        """{index in params: w} such that summing w x each parameter's squared gradient over the ranks
        gives the whole model's: 1 / size for parameters every rank holds whole, 1 / kv_replicas for a
        KV head several ranks share (for colo.ShardedMasterWeightOptimizer.clip_grad_norm_)."""
        replicated, kv = {id(p) for p in self.replicated}, {id(p) for p in self.kv_params}
        return {i: 1.0 / self.size if id(p) in replicated else 1.0 / self.kv_replicas
                for i, p in enumerate(params) if id(p) in replicated or id(p) in kv}

    def add_replicated(self, whole: list, kv: list = ()) -> None:
        """Trainable parameters beside the shards (a LoRA adapter's, colo.lora) that several ranks hold
        the same while each computes only part of their gradient: `whole` on every rank of the group
        (a column-parallel layer's A, a row-parallel layer's B), `kv` on the ranks sharing a KV head (a
        k/v projection's B; split like the heads when kv_replicas is 1). Each gradient is summed over
        those ranks as autograd produces it, so the copies stay identical; the norm counts them once."""
        _sum_gradients(list(whole), self.group, self.collectives)
        self.replicated.extend(whole)
        if self.kv_replicas > 1:
            _sum_gradients(list(kv), self.kv_group, self.collectives)
            self.kv_params.extend(kv)

    def clip_grad_norm_(self, optimizer, max_norm: float | None) -> float:
        """As MasterWeightOptimizer.clip_grad_norm_, with the whole model's norm; returns it."""
        norm = self.grad_norm(optimizer.params, optimizer.main_grads)
        clip_(optimizer.main_grads, norm, max_norm)
        optimizer.note_grad_norm(norm)   # not finite: its step() skips
        return norm

    def reference(self):
        raise NotImplementedError("a KL reference (beta > 0) with tensor parallelism")

    def master_names(self) -> None:
        return None  # the masters stay sharded per tensor-parallel rank: the model is saved as served

    def _publish_copies(self) -> dict:
        # Nothing to copy: the optimizer wrote into the engine's own shards.
        return dict(aliased_bytes=sum(p.nbytes for p in self.parameters()))


def local_config(config, size: int, vocab_rows: int):
    """The Hugging Face config whose model has one rank's shapes: heads, KV heads and the MLP's
    width divided by the tensor-parallel size, the vocabulary this rank's rows."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"{kv_heads} KV heads neither split over nor divide {size} tensor-parallel ranks "
                         "(vLLM refuses this engine)")
    uneven = [f"{name} {getattr(config, name)}" for name in _intermediate_sizes(config) if getattr(config, name) % size]
    if heads % size or uneven:
        raise ValueError(f"{heads} heads and {', '.join(uneven) or 'the intermediate sizes'} must split over "
                         f"{size} ranks (vLLM refuses this engine)")
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # Fewer KV heads than ranks: vLLM gives each rank one, replicated on size / kv_heads ranks.
    local.num_attention_heads, local.num_key_value_heads = heads // size, max(1, kv_heads // size)
    for field in _intermediate_sizes(config):  # the MLP's, and a MoE layer's experts' and shared expert's
        setattr(local, field, getattr(config, field) // size)
    local.vocab_size, local.pad_token_id = vocab_rows, None
    return local


def _intermediate_sizes(config) -> list[str]:
    return [name for name, value in vars(config).items()
            if name.endswith("intermediate_size") and isinstance(value, int) and value > 0]


def check_shardable(config, size: int) -> None:
    """Refuse, before any engine starts, a model whose shards this trainer cannot hold: sizes vLLM
    refuses (ValueError) and row-parallel biases (NotImplementedError)."""
    local_config(config, size, 1)
    for flag in ("attention_bias", "mlp_bias"):  # Llama-style configs: biases on o_proj / down_proj too
        if getattr(config, flag, False):
            raise NotImplementedError(f"{flag}=True: vLLM adds a row-parallel layer's bias on rank 0 only; colo's "
                                      "tensor-parallel trainer does not model that yet")


def shared_tp_model(llm) -> TensorParallelModel:
    """This rank's trainer model over the in-process tensor-parallel engine `llm` (built by
    colo.engine.build_llm under torchrun): its parameters are views of the engine's shards, in the
    engine's dtype, in training mode."""

    config = compat.engine_config_as_saved(llm)
    placement = compat.engine_placement(llm)
    if placement is None:
        raise RuntimeError("shared_tp_model needs an engine built by colo.engine.build_llm (its weights in a pool)")
    group, rank, size = compat.tensor_parallel_group(llm)
    checkpoint = compat.engine_model_source(llm)["pretrained_model_name_or_path"]
    whole = meta_model(config, compat.engine_dtype(llm), checkpoint)   # the whole model's names and shapes
    layout = compat.engine_layout(compat.engine_model(llm), whole, kept=placement.kept)
    buffers = [name for name in compat.persistent_buffers(whole) if name in layout.placements]
    if buffers:
        raise NotImplementedError(f"{buffers[0]}: a buffer the engine loads as a weight (a router's score "
                                  "correction); colo's tensor-parallel trainer shares parameters only")
    views, vocab = _shard_views(layout)
    start, rows = vocab["model.embed_tokens.weight"]
    local = local_config(config, size, rows)
    hf_model = meta_model(local, compat.engine_dtype(llm))
    counts = Collectives()
    params = _install(hf_model, views)
    embedding = VocabParallelEmbedding(params["model.embed_tokens.weight"], start, group, counts)
    hf_model.model.embed_tokens = embedding
    if "lm_head.weight" not in params:  # tied: vLLM's LM head is the embedding's parameter
        hf_model.lm_head.weight = embedding.weight
        views["lm_head.weight"] = views["model.embed_tokens.weight"]
        params["lm_head.weight"] = embedding.weight
    elif vocab["lm_head.weight"] != (start, rows):
        raise RuntimeError(f"colo misread the engine's layout: LM head rows {vocab['lm_head.weight']}, "
                           f"embedding rows {(start, rows)}")
    materialize_buffers(hf_model, embedding.weight.device)
    _add_collectives(hf_model, group, counts)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    replicas = size // kv_heads if kv_heads < size else 1
    kv_params = [p for name, p in params.items() if name.endswith(KV_PARAMETERS)] if replicas > 1 else []
    kv_group = _kv_replica_group(size, replicas) if replicas > 1 else None
    _sum_gradients(kv_params, kv_group, counts)
    kv_ids = {id(p) for p in kv_params}
    replicated = [params[name] for name in views
                  if views[name][1] is None and id(params[name]) not in kv_ids and name != "lm_head.weight"]
    # Whole on every rank but inside the split attention or MLP (Qwen3's per-head q/k norms, a MoE router, a
    # shared expert's gate): each rank's gradient is the part its heads or experts give, summed over the ranks.
    inside = [params[name] for name in views if views[name][1] is None and (".mlp." in name or ".self_attn." in name)
              and id(params[name]) not in kv_ids]
    _sum_gradients(inside, group, counts)
    everyone = _every_ranks_shards(views, group, size)
    layout = {name: Placed(params[name], tuple(shape), shard[0] if shard else 0,
                           tuple(everyone[name]) if shard else None)
              for name, (_, shard, shape) in views.items()}
    return TensorParallelModel(hf_model.train(), llm, group=group, rank=rank, size=size, vocab_start=start,
                               layout=layout, replicated=replicated, kv_replicas=replicas, kv_params=kv_params,
                               kv_group=kv_group, collectives=counts,
                               repack=[lin for lin in placement.linears if lin.stale_after_update])


def _every_ranks_shards(views: dict, group, size: int) -> dict:
    """{HF name: [each rank's (start, stop) segments]} for the sharded parameters (one small
    collective at start, so gathering whole weights later needs no metadata)."""
    mine = {name: shard[1] for name, (_, shard, _) in views.items() if shard is not None}
    everyone = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    return {name: [tuple(tuple(segment) for segment in ranks[name]) for ranks in everyone] for name in mine}


def _kv_replica_group(size: int, replicas: int):
    """The group of the ranks that hold this rank's KV head: vLLM gives rank r of each tensor-parallel
    group head r // replicas, and its groups are consecutive global ranks. Every rank of the job takes
    part in creating every group (torch.distributed's rule)."""
    world = dist.get_world_size()
    groups = [[base + head * replicas + i for i in range(replicas)]
              for base in range(0, world, size) for head in range(size // replicas)]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine


def _sum_gradients(params: list, group, counts: Collectives) -> None:
    """Sum each parameter's gradient over `group`: on the gradient each backward produces, before it is
    accumulated into .grad (summing the accumulated .grad would sum earlier micro-batches again)."""
    def hook(grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        counts.backward += 1
        return grad

    for p in params:
        p.register_hook(hook)


def _shard_views(layout) -> tuple[dict, dict]:
    """{HF name: (view of the engine tensor, (dim, segments) or None when whole, the whole shape)} and the
    vocabulary rows of the embedding and LM head: {HF name: (first row, rows)}."""
    if layout.unfilled:
        name = layout.unfilled[0]
        raise no_parameter_for(name, name, tuple(layout.tensors[name].param.shape))
    views, vocab = {}, {}
    for name, placement in layout.placements.items():
        if name.endswith(ROW_PARALLEL_BIASES):
            raise NotImplementedError(f"{name}: vLLM adds a row-parallel layer's bias on rank 0 "
                                      "only; colo's tensor-parallel trainer does not model that yet")
        if placement.view is None:
            raise NotImplementedError(f"{name}: this rank's part of it is not one view of an engine tensor "
                                      "(pieces: " + ", ".join(sorted({p.engine for p in placement.pieces})) +
                                      "); colo's tensor-parallel trainer holds views only")
        engine, strided = placement.view
        view = strided.of(layout.tensors[engine].param.detach())
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            vocab[name] = (placement.covered[1][0][0] if placement.covered else 0, view.shape[0])
        views[name] = (view, placement.covered, placement.hf_shape)
    return views, vocab


def _install(hf_model, views: dict) -> dict[str, torch.nn.Parameter]:
    """Replace the meta model's parameters with Parameters on the engine's views; shapes must match."""
    expected = dict(hf_model.named_parameters())
    installed = {}
    for name, (view, *_) in views.items():
        meta = expected.get(name)
        if meta is None:
            raise no_parameter_for(name, f"this rank's shard of {name}", view.shape)
        if tuple(meta.shape) != tuple(view.shape):
            raise shape_mismatch(name, meta.shape, view.shape, f"this rank's shard of {name}")
        module_name, _, attr = name.rpartition(".")
        param = torch.nn.Parameter(view, requires_grad=True)
        hf_model.get_submodule(module_name)._parameters[attr] = param
        installed[name] = param
    missing = [n for n in expected if n not in installed and n != "lm_head.weight"]
    if missing:
        raise no_place_for(missing[0], expected[missing[0]].shape)
    return installed


def _add_collectives(hf_model, group, counts: Collectives) -> None:
    def copy_input(module, args, kwargs):
        if args:
            return (_CopyToGroup.apply(args[0], group, counts), *args[1:]), kwargs
        kwargs["hidden_states"] = _CopyToGroup.apply(kwargs["hidden_states"], group, counts)
        return args, kwargs

    def reduce_output(module, args, output):
        return _ReduceFromGroup.apply(output, group, counts)

    for layer in hf_model.model.layers:
        layer.self_attn.register_forward_pre_hook(copy_input, with_kwargs=True)
        layer.mlp.register_forward_pre_hook(copy_input, with_kwargs=True)
        layer.self_attn.o_proj.register_forward_hook(reduce_output)
        layer.mlp.register_forward_hook(reduce_output)   # a dense MLP's down_proj, or a MoE layer's sum
    hf_model.lm_head.register_forward_pre_hook(copy_input, with_kwargs=True)
