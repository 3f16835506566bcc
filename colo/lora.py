"""LoRA with one copy: the base weights are the engine's (frozen), the adapter is the engine's LoRA slot.

    spec = colo.lora.LoraSpec(rank=16, alpha=32)
    llm = colo.engine.build_llm(path, pool, **spec.engine_options())   # vLLM's native LoRA, one slot
    model = colo.shared_model(llm).hf_model                             # base: the engine's tensors
    adapter = colo.lora.share_adapter(model, llm, spec, workdir)        # A/B: views of the engine's slot
    opt = colo.MasterWeightOptimizer(adapter.parameters(), scales=adapter.scales(), lr=1e-4)
    ...; opt.step(); adapter.publish()                                  # 0 bytes: the engine reads the slot
    llm.generate(prompts, params, lora_request=adapter.request)
    adapter.save_pretrained(out)                                        # PEFT's format

vLLM keeps every adapter in preallocated per-layer slots (`lora_a_stacked` / `lora_b_stacked`, one
slice per fused sub-projection, rank padded to `max_lora_rank`) and computes
`out += (x @ A.T) @ B.T` from them. colo loads a zero adapter into the one slot once (the only
adapter read from disk), pins it, and makes each trained linear layer of the Hugging Face model
compute the same thing from views of that slot (a forward hook; the layer's `lora_A` / `lora_B`
parameters). The optimizer writes the slot, the engine reads it: no merge, no `load_weights`, no
reload.

vLLM multiplies PEFT's scaling (alpha / rank) into B when it sets an adapter, so the slot's B is
`scaling * B_peft`. To train exactly as PEFT does (same learning rate, clipping and weight decay
meaning), the optimizer steps fp32 masters in PEFT's units: `scales()` gives each parameter's factor
for colo.MasterWeightOptimizer (1 for A, `scaling` for B), which also keeps fp32 masters for bf16
adapters. `save_pretrained` writes PEFT's B.

With tensor parallelism (`share_adapter(tp.hf_model, llm, spec, workdir, tp=tp)`, tp the rank's
colo.tensor_parallel.TensorParallelModel) each rank's adapter is a view of its own slot, which holds
what vLLM gives that rank: for column-parallel layers (q/k/v, gate/up) its output rows of B and the
whole A, for row-parallel ones (o_proj, down_proj) its input columns of A and the whole B. The
forward is vLLM's: a column layer adds B_r (A x) to its output shard; a row layer adds B (A_r x_r) to
its partial output, summed over the ranks by the layer's all-reduce with the base's. The pieces every
rank holds whole (A of a column layer, B of a row layer; a shared KV head's B) get their gradients
summed over the ranks that compute parts of them (TensorParallelModel.add_replicated). Checkpoints
and PEFT files hold the whole adapter, gathered on the group's first rank.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import vllm_compat as compat
from .hf_format import write_adapter_dir
from .model_classes import PROJECTORS, vision_tower_parameters
from .peft_format import PEFT_PREFIX, peft_adapter_state, write_adapter
from .shared import EngineViews, Placed, Reference
from .regions import WEIGHTS

# Every linear layer of a Llama/Qwen2 decoder layer (PEFT's "all-linear" for these models).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_ID = 1            # vLLM's int id of the adapter colo trains
ADAPTER_NAME = "colo"


@dataclass(frozen=True)
class LoraSpec:
    """What adapter to train: rank, alpha (PEFT's lora_alpha; scaling = alpha / rank), the names of
    the linear layers it adapts (the last part of a module name, as PEFT's target_modules), dropout
    on the adapter's input while training (PEFT's lora_dropout)."""
    rank: int
    alpha: float = 8.0     # PEFT's default lora_alpha
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= compat.LORA_SLOT_RANKS[-1]:
            raise ValueError(f"LoRA rank must be an int in [1, {compat.LORA_SLOT_RANKS[-1]}], got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be a number > 0, got {self.alpha!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t and "." not in t for t in targets):
            raise ValueError(f"LoRA targets must be module names such as 'q_proj', got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(sorted(set(targets))))
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def engine_options(self) -> dict:
        """The vllm.LLM / build_llm options that give the engine one adapter slot of this rank."""
        return compat.lora_engine_options(self.rank)

    def peft_config(self, base_model: str = "") -> dict:
        """adapter_config.json as PEFT writes it (what PEFT and vLLM read back)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": self.dropout, "target_modules": sorted(self.targets), "bias": "none",
                "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
                "base_model_name_or_path": base_model, "inference_mode": True}


def target_modules(hf_model, spec: "LoraSpec") -> dict:
    """{name: linear layer} the adapter adapts: those named one of spec.targets, in the language model
    only (vLLM adapts no vision tower or projector layer); a ValueError where there is none."""
    outside = outside_language_model(hf_model)
    modules = {name: m for name, m in hf_model.named_modules()
               if name.rpartition(".")[2] in spec.targets and isinstance(m, torch.nn.Linear)
               and not outside(name, m.weight)}
    if not modules:
        names = sorted({n.rpartition(".")[2] for n, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"no linear layer of the model is named one of {list(spec.targets)} (its linear layers: "
                         f"{', '.join(names)})")
    return modules


def check_targets(config, spec: "LoraSpec") -> None:
    """target_modules' refusal before any engine starts, on the model of transformers `config` built on
    the meta device (no memory), and check_engine_takes_lora's."""
    from .shared import meta_model

    check_engine_takes_lora(config)
    target_modules(meta_model(config, torch.float32), spec)


def check_engine_takes_lora(config) -> None:
    """NotImplementedError, before any engine starts, for a model whose vLLM class takes no adapter
    (LLaVA-OneVision's): vLLM would refuse it only after loading the weights."""
    refusal = compat.lora_refusal(config)
    if refusal is not None:
        raise NotImplementedError(refusal)


def outside_language_model(hf_model):
    """A test `(name, weight) -> bool`: whether a layer is a vision tower's (its weight is among
    vision_tower_parameters) or a projector's (a part of its name is one), where vLLM has no adapter
    slot; False for every layer of a text-only model."""
    tower = {id(p) for p in vision_tower_parameters(hf_model)} if hasattr(hf_model, "config") else set()
    return lambda name, weight: id(weight) in tower or any(part in PROJECTORS for part in name.split("."))


def slot_bytes(hf_config, spec: LoraSpec, dtype: torch.dtype, tensor_parallel: int = 1) -> int:
    """Bytes of the engine's one adapter slot for a Llama/Qwen2-shaped model (on one rank of
    `tensor_parallel`): vLLM makes A and B slices of rank `max_lora_rank` for every linear layer of
    every decoder layer, targeted or not; each rank holds its part of the split B or A."""
    from .kv_sizing import layer_configs

    t = tensor_parallel
    rank = spec.engine_options()["max_lora_rank"]
    elements = 0
    for c in layer_configs(hf_config.get_text_config()):   # (a vision-language model's language model)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        q, kv = c.num_attention_heads // t * head_dim, max(1, c.num_key_value_heads // t) * head_dim
        h, i = c.hidden_size, c.intermediate_size // t
        elements += (h + q) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h)  # q o, k v, gate up, down: in + out each
    return rank * elements * torch.empty((), dtype=dtype).element_size()


@dataclass
class _Layer:
    module: torch.nn.Module
    lora_a: torch.nn.Parameter     # rank x in: a view of the engine's slot
    lora_b: torch.nn.Parameter     # out x rank: a view of the engine's slot (scale x PEFT's B)
    scale: float                   # PEFT's scaling of this layer (alpha / rank)
    hook: object = None
    split: str | None = None       # tensor parallelism: "A" or "B", the one vLLM splits over the ranks
    piece: tuple | None = None     # and (dim, every rank's (start, stop), whole shape) of this rank's part
                                   # (None: the whole, a KV head that all ranks share)


class SharedAdapter(EngineViews):
    """The trainer's adapter, a view of the engine's adapter slot; see the module docstring.

    request: the vllm LoRARequest to generate with; slot: the engine's slot index; layers: {Hugging
    Face module name: its adapter}; tp: this rank's colo.tensor_parallel.TensorParallelModel, with tensor
    parallelism (the forward, the gradient norm and gathering go through its group); base: the views
    of the frozen base model (tp, or the engine's colo.share_weights)."""

    def __init__(self, spec: LoraSpec, llm, hf_model, request, slot: int, *, tp=None):
        super().__init__(llm, hf_model, shared_by="colo.lora.share_adapter", group=tp.group if tp else None,
                         rank=tp.rank if tp else 0)
        self.spec, self.request, self.slot, self.tp = spec, request, slot, tp
        self.base = tp if tp is not None else getattr(llm, "colo_shared_weights", None)
        self.layers: dict[str, _Layer] = {}
        self.enabled = True

    def watch_layers(self) -> None:
        """Watch the adapter's parameters as they are now: `{module}.lora_A` / `.lora_B`, whole, or with
        tensor parallelism the part of the split one this rank holds."""
        layout = {}
        for name, layer in self.layers.items():
            for which, param in (("A", layer.lora_a), ("B", layer.lora_b)):
                if layer.piece is not None and layer.split == which:
                    dim, ranges, shape = layer.piece
                    layout[f"{name}.lora_{which}"] = Placed(param, tuple(shape), dim,
                                                            tuple(tuple(map(tuple, segments)) for segments in ranges))
                else:
                    layout[f"{name}.lora_{which}"] = Placed(param, tuple(param.shape))
        self.watch(layout)

    def scales(self) -> dict[torch.nn.Parameter, float]:
        """Engine units per PEFT unit of each parameter (A: 1, B: alpha/rank), for the master optimizer."""
        return {p: (layer.scale if p is layer.lora_b else 1.0)
                for layer in self.layers.values() for p in (layer.lora_a, layer.lora_b)}

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- the contract's hooks: the base model's, with the adapter on top -----------------------------
    @property
    def weights(self) -> EngineViews | None:
        return self.base

    @property
    def trainer_model(self):
        return self.tp.trainer_model if self.tp is not None else self.hf_model

    def grad_norm(self, params: list, grads: list) -> float:
        return self.tp.grad_norm(params, grads) if self.tp is not None else super().grad_norm(params, grads)

    def norm_weights(self, params: list) -> dict[int, float]:
        return self.tp.norm_weights(params) if self.tp is not None else {}

    @property
    def collective_count(self) -> int:
        return self.tp.collective_count if self.tp is not None else 0

    def reference(self) -> "AdapterOff":
        """The frozen base: the same model with its adapter off, at no memory cost."""
        return AdapterOff(self.hf_model, self)

    def master_names(self) -> None:
        return None  # saved from the slot's values, in PEFT's format

    def write_pretrained(self, directory, state: dict, *, base_dir, dtype=None, masters=None, merge: bool = False):
        """A PEFT adapter directory with the tokenizer (colo.hf_format.write_adapter_dir); merge: also
        `merged/`, the base with the adapter merged."""
        return write_adapter_dir(state, self.spec, base_dir, directory, dtype, merge=merge)

    def load_trainer_checkpoint(self, directory, masters: dict | None = None) -> bool:
        """The checkpoint's PEFT adapter written into the slot (and the masters): PEFT's own loading would
        recast a bf16 adapter into new fp32 Parameters, cutting the trainer's adapter off the engine's slot."""
        spec, state = read_adapter(directory)
        if (spec.rank, spec.alpha) != (self.spec.rank, self.spec.alpha):
            raise ValueError(f"{directory}: an adapter of rank {spec.rank}, alpha {spec.alpha}; this trainer's is "
                             f"rank {self.spec.rank}, alpha {self.spec.alpha}")
        self.load_peft_state_dict(state, masters)
        return True

    def _check_served(self) -> None:
        if compat.adapter_slot(self.llm, ADAPTER_ID) != self.slot:
            raise RuntimeError(f"vLLM no longer serves colo's adapter from slot {self.slot} (it was removed or "
                               "evicted); the trained adapter is in the trainer's optimizer masters")

    def _publish_copies(self) -> dict:
        # Nothing to copy: the engine reads the slot the optimizer wrote (with an adapter the base never
        # changes: nothing of it to publish, or repack on a CPU).
        nbytes = sum(p.nbytes for p in self.parameters())
        return dict(aliased_bytes=nbytes, adapter_bytes=nbytes)

    @contextlib.contextmanager
    def disabled(self):
        """The trainer's model without the adapter (the base, e.g. as a KL reference) inside the block."""
        self.enabled, before = False, self.enabled
        try:
            yield
        finally:
            self.enabled = before

    @contextlib.contextmanager
    def _unregistered(self):
        """The layers without their lora_A/lora_B parameters inside the block (so colo.share_weights
        sees the base model only, when a rebuilt engine takes the base weights over)."""
        for layer in self.layers.values():
            del layer.module._parameters["lora_A"], layer.module._parameters["lora_B"]
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.module.register_parameter("lora_A", layer.lora_a)
                layer.module.register_parameter("lora_B", layer.lora_b)

    # -- PEFT's format ------------------------------------------------------------------------------
    def peft_state_dict(self, full: dict | None = None) -> dict[str, torch.Tensor] | None:
        """The adapter as PEFT names and scales it (B divided by alpha/rank), in the adapter's dtype, from
        `full` (a full_state_dict) or gathered now (with tensor parallelism: None off the first rank)."""
        full = self.full_state_dict() if full is None else full
        return None if full is None else peft_adapter_state(full, {n: layer.scale for n, layer in self.layers.items()})

    def save_beside_checkpoint(self, out_dir, *, base_model: str, full: dict | None = None) -> None:
        """OUT/adapter: the newest adapter in PEFT's format, for PEFT and vLLM."""
        self.save_pretrained(Path(out_dir) / "adapter", base_model=base_model, full=full)

    def save_pretrained(self, directory, base_model: str = "", full: dict | None = None) -> Path | None:
        """Write adapter_config.json and adapter_model.safetensors (PEFT's format; loads in PEFT and
        in vLLM with a LoRARequest). With tensor parallelism a collective (unless `full`, a
        full_state_dict, is given) and the group's first rank writes; None on the others."""
        state = self.peft_state_dict(full)
        return None if state is None else write_adapter(directory, self.spec, state, base_model)

    def load_peft_state_dict(self, state: dict, masters: dict | None = None) -> None:
        """Write a PEFT-format adapter of this spec into the slot (and so into the trainer's parameters);
        `masters` ({parameter: fp32 tensor}, share_peft_adapter's) get its values in PEFT's units."""
        expected = {f"{PEFT_PREFIX}{n}.lora_{x}.weight" for n in self.layers for x in "AB"}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"not an adapter for these layers: missing {missing[:3]}, unexpected {extra[:3]}")
        with torch.no_grad():
            for name, layer in self.layers.items():
                a, b = state[f"{PEFT_PREFIX}{name}.lora_A.weight"], state[f"{PEFT_PREFIX}{name}.lora_B.weight"]
                if tuple(a.shape) != tuple(layer.lora_a.shape) or tuple(b.shape) != tuple(layer.lora_b.shape):
                    raise ValueError(f"{name}: adapter shapes {tuple(a.shape)}/{tuple(b.shape)}, expected "
                                     f"{tuple(layer.lora_a.shape)}/{tuple(layer.lora_b.shape)}")
                layer.lora_a.copy_(a)
                layer.lora_b.copy_(b.float() * layer.scale)
                if masters is not None:
                    masters[layer.lora_a].copy_(a)
                    masters[layer.lora_b].copy_(b)

    def rebind(self, llm) -> None:
        # The base model alone is the base views' (colo.share_weights checks its parameters and its forward).
        with self._unregistered(), self.disabled():
            self.base.rebind(llm)
        values = [p.detach().clone() for p in self.parameters()]
        fresh = _activate(llm, self.spec, {n: layer.module for n, layer in self.layers.items()}, self.request)
        with torch.no_grad():
            for name, layer in self.layers.items():
                layer.lora_a.data, layer.lora_b.data = fresh[name].lora_a, fresh[name].lora_b
            for p, v in zip(self.parameters(), values):
                p.copy_(v)
        self.llm, self.slot = llm, compat.adapter_slot(llm, ADAPTER_ID)
        self.watch_layers()

    def _detach_kind(self) -> None:
        self.base.detach()


def share_adapter(hf_model, llm, spec: LoraSpec, workdir, *, seed: int = 0, tp=None) -> SharedAdapter:
    """Give `hf_model` (whose base weights are the engine's: colo.shared_model) a trainable LoRA adapter
    that is the engine's adapter slot. The base parameters are frozen; A starts as PEFT's (Kaiming
    uniform, from `seed`), B at zero. `workdir`: where the zero adapter the engine loads once goes.
    tp: with a tensor-parallel engine, this rank's colo.tensor_parallel.TensorParallelModel (hf_model
    is its hf_model); each rank draws the whole A from `seed` and keeps its part, so every tensor-parallel
    size starts from the same adapter."""
    from vllm.lora.request import LoRARequest

    if tp is None and compat.tensor_parallel_group(llm)[2] > 1:
        raise ValueError("the engine is tensor-parallel: pass this rank's TensorParallelModel as tp= "
                         "(colo.tensor_parallel.shared_tp_model)")
    if tp is not None and spec.dropout:
        raise NotImplementedError("LoRA dropout with tensor parallelism: the ranks' dropout masks of an input they "
                                  "all hold would have to agree; train with dropout 0")
    modules = target_modules(hf_model, spec)
    if any(hasattr(m, "lora_A") for m in modules.values()):
        raise ValueError("this model already has LoRA adapters (lora_A parameters)")
    # The whole (out, in) of each layer: the engine reads this adapter from disk and takes its rank's parts.
    shapes = {name: tp.layout[f"{name}.weight"].shape if tp is not None else (m.out_features, m.in_features)
              for name, m in modules.items()}
    directory = Path(workdir) / "colo-adapter-slot"
    zero = {}
    for name, (out_features, in_features) in shapes.items():
        zero[f"{PEFT_PREFIX}{name}.lora_A.weight"] = torch.zeros(spec.rank, in_features)
        zero[f"{PEFT_PREFIX}{name}.lora_B.weight"] = torch.zeros(out_features, spec.rank)
    write_adapter(directory, spec, zero)
    request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(directory))
    slices = _activate(llm, spec, modules, request)
    for p in hf_model.parameters():
        p.requires_grad_(False)
    adapter = SharedAdapter(spec, llm, hf_model, request, compat.adapter_slot(llm, ADAPTER_ID), tp=tp)
    generator = torch.Generator().manual_seed(seed)
    for name, module in modules.items():
        a_view, b_view, piece = slices[name].lora_a, slices[name].lora_b, None
        if slices[name].split:
            piece = _piece(tp, name, slices[name].split, spec.rank)
        in_features = shapes[name][1]
        with torch.no_grad():  # PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0
            bound = 1 / math.sqrt(in_features)
            whole_a = torch.rand((spec.rank, in_features), generator=generator).mul_(2 * bound).sub_(bound)
            a_view.copy_(_rank_part(whole_a, piece, tp.rank) if piece and slices[name].split == "A" else whole_a)
            b_view.zero_()
        lora_a, lora_b = torch.nn.Parameter(a_view), torch.nn.Parameter(b_view)
        module.register_parameter("lora_A", lora_a)
        module.register_parameter("lora_B", lora_b)
        layer = _Layer(module, lora_a, lora_b, spec.scaling, split=slices[name].split, piece=piece)
        # Prepended: a tensor-parallel row layer's all-reduce (a later hook) sums base and delta together.
        layer.hook = module.register_forward_hook(_adapter_forward(adapter, spec.dropout), prepend=True)
        adapter.layers[name] = layer
    if tp is not None:  # column layers' A and row layers' B: whole on every rank; a shared KV head's B
        layers = adapter.layers.values()
        tp.add_replicated([layer.lora_a if layer.split == "B" else layer.lora_b for layer in layers],
                          kv=[layer.lora_b for name, layer in adapter.layers.items()
                              if name.rpartition(".")[2] in ("k_proj", "v_proj")])
    adapter.watch_layers()
    return adapter


def _rank_part(whole: torch.Tensor, piece: tuple, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a whole A or B split as `piece` (_piece's) says."""
    dim, ranges, _ = piece
    return torch.cat([whole.narrow(dim, start, stop - start) for start, stop in ranges[rank]], dim)


def _piece(tp, name: str, split: str, rank: int) -> tuple | None:
    """(dim, every rank's (start, stop) segments, whole shape) of this rank's part of a layer's A or B: the rows of
    B / columns of A that its base weight's shard has (vLLM slices both alike); None when that is the
    whole (a KV head every rank holds)."""
    weight = tp.layout[f"{name}.weight"]
    out_features, in_features = weight.shape
    dim = 0 if split == "B" else 1
    if weight.ranges is None and name.endswith(("k_proj", "v_proj")) and tp.kv_replicas == tp.size:
        return None
    if weight.ranges is None or weight.dim != dim:
        raise RuntimeError(f"colo misread the engine's layout: {name}'s adapter is split ({split}) but its weight "
                           f"is {'whole' if weight.ranges is None else f'split along {weight.dim}'}")
    return dim, list(weight.ranges), (out_features, rank) if split == "B" else (rank, in_features)


def _activate(llm, spec: LoraSpec, modules, request) -> dict[str, compat.AdapterSlice]:
    """Load the adapter into the engine's slot and return {HF module name: its slice, views of the slot}."""
    slot = compat.activate_adapter(llm, request)
    engine_slices = {s.module: s for s in compat.adapter_slices(llm, slot, spec.rank)}
    engine_names = compat.engine_module_names(llm, modules)
    missing = [name for name in modules if engine_names[name] not in engine_slices]
    if missing:
        raise NotImplementedError(f"the engine has no adapter slot for {missing[0]} (vLLM adapts "
                                  f"{sorted(engine_slices)[:4]}...)")
    by_name = {name: engine_slices[engine_names[name]] for name in modules}
    region = compat.engine_placement(llm).pool.regions[WEIGHTS] if compat.engine_placement(llm) else None
    for name, module in modules.items():
        s = by_name[name]
        if region is not None and not (region.contains(s.lora_a) and region.contains(s.lora_b)):
            raise RuntimeError(f"{name}: the engine's adapter slot is not in colo's weights region")
        base = getattr(module, "base_layer", module)  # PEFT's LoRA layer wraps the linear
        expected = ((spec.rank, base.in_features), (base.out_features, spec.rank))
        if (tuple(s.lora_a.shape), tuple(s.lora_b.shape)) != expected:
            raise RuntimeError(f"{name}: the engine's adapter slot holds A {tuple(s.lora_a.shape)} and B "
                               f"{tuple(s.lora_b.shape)}, the layer needs {expected[0]} and {expected[1]}")
    return by_name


class AdapterOff(Reference):
    """The KL reference with an adapter: the shared base itself, the adapter off inside model()'s
    block (no memory of its own, nothing for a checkpoint to keep)."""

    def __init__(self, hf_model, adapter: SharedAdapter):
        self.hf_model, self.adapter = hf_model, adapter

    @contextlib.contextmanager
    def model(self):
        with self.adapter.disabled():
            yield self.hf_model


def _adapter_forward(adapter: SharedAdapter, dropout: float):
    def hook(module, args, output):
        if not adapter.enabled:
            return output
        x = args[0]
        if dropout and module.training:
            x = F.dropout(x, dropout)
        # What vLLM computes from the slot (PunicaWrapper.add_lora_linear, scale 1.0).
        return output + F.linear(F.linear(x, module.lora_A), module.lora_B)
    return hook


def read_adapter(directory) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A PEFT-format LoRA adapter from `directory`: its spec and its tensors (PEFT's names)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    if config.get("use_rslora") or config.get("use_dora"):
        raise NotImplementedError(f"{directory}: rsLoRA and DoRA adapters are not supported")
    targets = config.get("target_modules") or DEFAULT_TARGETS
    spec = LoraSpec(int(config["r"]), float(config.get("lora_alpha", 8)), tuple(targets),
                    float(config.get("lora_dropout") or 0.0))
    return spec, load_file(str(directory / "adapter_model.safetensors"))



# --- PEFT models (colo.trl with peft_config) -------------------------------------------------------

def peft_lora_spec(peft_model, adapter_name: str = "default") -> LoraSpec:
    """The LoraSpec of a PEFT model's adapter, or NotImplementedError naming what colo cannot share."""
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or adapter_name not in configs:
        raise ValueError(f"not a PEFT model with an adapter named {adapter_name!r}")
    others = set(configs) - {adapter_name, "ref"}  # "ref": TRL's frozen copy of a pretrained adapter (beta > 0)
    if others:
        raise NotImplementedError(f"colo shares one LoRA adapter with the engine ({adapter_name!r}, and TRL's "
                                  f"'ref' copy on the trainer's side); this model also has {sorted(others)}")
    c = configs[adapter_name]
    unsupported = {
        "peft_type": str(getattr(c, "peft_type", "")).rpartition(".")[2] not in ("LORA",),
        "use_dora": bool(getattr(c, "use_dora", False)),
        "bias": getattr(c, "bias", "none") != "none",
        "lora_bias": bool(getattr(c, "lora_bias", False)),
        "modules_to_save": bool(getattr(c, "modules_to_save", None)),
        "rank_pattern": bool(getattr(c, "rank_pattern", None)),
        "alpha_pattern": bool(getattr(c, "alpha_pattern", None)),
        "trainable_token_indices": bool(getattr(c, "trainable_token_indices", None)),
        "layers_to_transform": getattr(c, "layers_to_transform", None) is not None,
    }
    refused = [k for k, bad in unsupported.items() if bad]
    if refused:
        raise NotImplementedError(f"colo shares plain LoRA adapters of linear layers with vLLM's adapter slots; "
                                  f"this adapter sets {', '.join(refused)}, which colo does not support")
    layers = _peft_layers(peft_model, adapter_name)
    check_engine_takes_lora(peft_model.get_base_model().config)
    _refuse_tower_layers(peft_model.get_base_model(), layers)
    return LoraSpec(int(c.r), float(c.lora_alpha), tuple({n.rpartition(".")[2] for n in layers}),
                    float(c.lora_dropout or 0.0))


def _refuse_tower_layers(hf_model, layers: dict) -> None:
    """NotImplementedError where a PEFT adapter adapts a vision tower's or projector's layer: vLLM's
    adapter slots are the language model's (a plain `target_modules=["q_proj"]` also matches a SigLIP
    or CLIP tower's q_proj). The message gives a `target_modules` that keeps the language model's."""
    outside_lm = outside_language_model(hf_model)
    outside = [name for name, m in layers.items() if outside_lm(name, m.base_layer.weight)]
    if not outside:
        return
    inside = [name for name in layers if name not in outside]
    shorts = "|".join(sorted({n.rpartition(".")[2] for n in layers}))
    prefix = os.path.commonprefix(inside).rpartition(".layers.")[0] if inside else ""
    suggestion = (f"target_modules=r\"{re.escape(prefix)}\\..*\\.({shorts})\"" if prefix
                  else "target_modules naming the language model's layers only")
    raise NotImplementedError(
        f"the PEFT adapter adapts {len(outside)} layer(s) of the vision tower or projector ({outside[0]}, ...); "
        f"vLLM serves adapters of the language model's layers only, so colo shares those: use {suggestion} "
        "in the LoraConfig (a regular expression PEFT matches against the whole name)")


def _peft_layers(peft_model, adapter_name: str) -> dict[str, torch.nn.Module]:
    """PEFT's LoRA layers by their name in the Hugging Face model (`model.layers.0.self_attn.q_proj`)."""
    base = peft_model.get_base_model()
    layers = {}
    for name, module in base.named_modules():
        holders = (getattr(module, "lora_A", None), getattr(module, "lora_embedding_A", None))  # PEFT's LoraLayer
        if not any(isinstance(h, (torch.nn.ModuleDict, torch.nn.ParameterDict)) and adapter_name in h for h in holders):
            continue
        if not isinstance(getattr(module, "base_layer", None), torch.nn.Linear):
            raise NotImplementedError(f"{name}: colo shares adapters of linear layers only, not of a "
                                      f"{type(getattr(module, 'base_layer', module)).__name__}")
        layers[name] = module
    if not layers:
        raise ValueError(f"the PEFT model has no LoRA layer for adapter {adapter_name!r}")
    return layers


@contextlib.contextmanager
def peft_base_layers(peft_model, adapter_name: str = "default"):
    """Inside the block, the PEFT model's Hugging Face model has its plain linear layers back in place
    of PEFT's LoRA wrappers (the same nn.Linear objects), so colo.share_weights sees the base model."""
    base = peft_model.get_base_model()
    layers = _peft_layers(peft_model, adapter_name)
    swapped = []
    for name, module in layers.items():
        parent = base.get_submodule(name.rpartition(".")[0]) if "." in name else base
        short = name.rpartition(".")[2]
        setattr(parent, short, module.base_layer)
        swapped.append((parent, short, module))
    try:
        yield base
    finally:
        for parent, short, module in swapped:
            setattr(parent, short, module)


def share_peft_adapter(peft_model, llm, workdir, adapter_name: str = "default") -> tuple[SharedAdapter, dict]:
    """Make a PEFT model's LoRA parameters views of the engine's adapter slot, with their values.

    The slot holds PEFT's B times the layer's scaling (vLLM's convention), so each layer's `scaling`
    becomes 1 (its forward computes the same function from the slot) and B's gradient is multiplied by
    the scaling as autograd makes it (PEFT's gradient, so clipping sees PEFT's norm). Returns the
    SharedAdapter and {parameter: its fp32 values in PEFT's units}, the masters TRL's optimizer steps
    (colo.optimizer_masters.FP32Masters with `adapter.scales()`)."""
    from vllm.lora.request import LoRARequest

    spec = peft_lora_spec(peft_model, adapter_name)
    if compat.tensor_parallel_group(llm)[2] > 1:
        raise NotImplementedError("PEFT adapters of tensor-parallel engines are not shared (colo.grpo's are)")
    layers = _peft_layers(peft_model, adapter_name)
    directory = Path(workdir) / "colo-adapter-slot"
    zero = {}
    for name, module in layers.items():
        zero[f"{PEFT_PREFIX}{name}.lora_A.weight"] = torch.zeros(spec.rank, module.base_layer.in_features)
        zero[f"{PEFT_PREFIX}{name}.lora_B.weight"] = torch.zeros(module.base_layer.out_features, spec.rank)
    write_adapter(directory, spec, zero)
    request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(directory))
    slices = _activate(llm, spec, layers, request)
    adapter = SharedAdapter(spec, llm, peft_model, request, compat.adapter_slot(llm, ADAPTER_ID))
    masters = {}
    for name, module in layers.items():
        a_view, b_view = slices[name].lora_a, slices[name].lora_b
        lora_a, lora_b = module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight
        scale = float(module.scaling[adapter_name])
        with torch.no_grad():
            masters[lora_a], masters[lora_b] = lora_a.detach().float().clone(), lora_b.detach().float().clone()
            a_view.copy_(lora_a)
            b_view.copy_(lora_b.float() * scale)
        lora_a.data, lora_b.data = a_view, b_view
        module.scaling[adapter_name] = 1.0
        layer = _Layer(module, lora_a, lora_b, scale)
        layer.hook = lora_b.register_hook(lambda grad, s=scale: grad * s)
        adapter.layers[name] = layer
    adapter.watch_layers()
    compat.serve_adapter_by_default(llm, request)
    return adapter, masters
