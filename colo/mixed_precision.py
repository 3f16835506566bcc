"""Train 16-bit parameters with any torch optimizer stepping fp32 master weights.

    model = colo.shared_model(llm).hf_model                 # bf16 parameters: the engine's own tensors
    opt = colo.MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5)
    loss.backward()                                         # gradients accumulate in fp32 (main grads)
    opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()   # fp32 step, rounded bf16 written in place
    shared.publish()                                        # the engine serves the new bf16 weights

The engine serves bf16 and the trainer's parameters are those bf16 tensors, so there is one copy of
the weights; what needs fp32 lives with the optimizer: fp32 master weights (4 bytes per parameter)
and the inner optimizer's state (AdamW: 8), and the gradients are accumulated in fp32 main-gradient
buffers (4), as Megatron-LM does: autograd produces each 16-bit gradient, a hook adds it to the fp32
buffer and drops it. After the inner step the masters are rounded (to nearest even) into the 16-bit
parameters in place, so their addresses, and everything that reads them, stay.

master_region / grad_region: colo.Region objects for the masters and the main gradients (e.g. the
GRPO scheduler's `optimizer` and `grads` regions); None allocates them with torch.
"""
from __future__ import annotations

import logging
import math

import torch

from .clipping import clip_, gradients_finite, log_skipped_step

logger = logging.getLogger(__name__)

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class MainGradientOptimizer:
    """What colo's master-weight optimizers share: hooks that add each parameter's gradient to its
    fp32 main gradient (`self.main_grads[i]`) as autograd produces it, and the inner optimizer's
    `param_groups` and `state` (what LR schedulers and checkpoints read).

    An unscaled parameter's fp32 main gradient is also its `main_grad` attribute (Megatron-LM's
    name), so code that sums a gradient over pieces can add each piece there in fp32 instead of
    handing autograd 16-bit partial sums (colo.grpo.logprobs' chunked head does)."""

    def _register_hooks(self) -> None:
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate(i)) for i, p in enumerate(self.params)]
        for i, p in enumerate(self.params):
            if not self.param_scales or self.param_scales[i] == 1.0:
                p.main_grad = self.main_grads[i]

    param_scales: list[float] | None = None  # MasterWeightOptimizer(scales=...): parameter units per master unit
    skipped_steps = 0                        # steps refused because the gradients were not finite
    _grad_norm: float | None = None          # the norm clip_grad_norm_ (or note_grad_norm) saw since the last step

    def note_grad_norm(self, norm: float) -> None:
        """The gradient norm a caller took for these gradients (a tensor-parallel model's clip), for step()."""
        self._grad_norm = norm

    def _finite_step(self) -> bool:
        """Whether step() may step: the gradient norm taken since the last step, or (none taken) a check of
        the gradients themselves, is finite. A step on a NaN or inf gradient would write NaN into the
        weights the engine serves: it is skipped (counted in skipped_steps), the weights left as they are."""
        norm, self._grad_norm = self._grad_norm, None
        finite = math.isfinite(norm) if norm is not None else self._gradients_finite()
        if not finite:
            self.skipped_steps += 1
            log_skipped_step(logger, type(self).__name__, self.skipped_steps)
        return finite

    def _gradients_finite(self) -> bool:
        return gradients_finite([self.grad_flat])

    def _accumulate(self, i: int):
        main = self.main_grads[i]
        scale = self.param_scales[i] if self.param_scales else 1.0

        def hook(param):
            if param.grad is None:  # the gradient went straight to main_grad (colo.grpo.logprobs' head)
                return
            main.add_(param.grad, alpha=scale)  # in fp32; the parameter's own gradient is dropped at once
            param.grad = None
        return hook

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for p in self.params:
            if getattr(p, "main_grad", None) is not None:
                del p.main_grad


class MasterWeightOptimizer(MainGradientOptimizer):
    """`optimizer_class` over fp32 masters of 16-bit `params`; see the module docstring.

    params: 16-bit tensors that require grad, or param-group dicts of them (torch's format).
    The inner optimizer is `.optimizer` (give it to an LR scheduler); `.masters` are its parameters.
    scales: {parameter: s} where a parameter holds s times what the optimizer should step (a LoRA B
        in vLLM's slot holds alpha/rank x PEFT's B; colo.lora): its master is param / s, its main
        gradient s x its gradient, and the step writes s x master back, so the inner optimizer,
        clipping and weight decay see the unscaled parameter. fp32 parameters are accepted then.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, master_region=None, grad_region=None,
                 scales: dict | None = None, rounding: str = "nearest", seed: int = 0, **optimizer_kwargs):
        self.rounding = MasterRounding(rounding, seed)
        groups = param_groups(params)
        dtypes = (*_SIXTEEN_BIT, torch.float32) if scales else _SIXTEEN_BIT
        self.params = checked_params(groups, "MasterWeightOptimizer", dtypes)
        if scales:
            unknown = [i for i, p in enumerate(self.params) if p not in scales]
            if unknown or len(scales) != len(self.params):
                raise ValueError(f"scales must name every parameter once (parameter {unknown[:1]} has none)")
            self.param_scales = [float(scales[p]) for p in self.params]
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device
        self.master_flat = fp32_buffer(master_region, numel, device)
        self.grad_flat = fp32_buffer(grad_region, numel, device)
        self.masters, self.main_grads = [], []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                master = self.master_flat[offset:offset + p.numel()].view(p.shape)
                master.copy_(p)
                self.masters.append(master)
                self.main_grads.append(self.grad_flat[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            if self.param_scales:
                torch._foreach_div_(self.masters, self.param_scales)
        self.grad_flat.zero_()
        for master, grad in zip(self.masters, self.main_grads):
            master.grad = grad
        index = {id(p): i for i, p in enumerate(self.params)}
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [self.masters[index[id(p)]] for p in g["params"]]} for g in groups]
        self.optimizer = optimizer_class(inner_groups, **optimizer_kwargs)
        self._register_hooks()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 main gradients (they stay allocated: the masters' .grad are views of them)."""
        self.grad_flat.zero_()
        for p in self.params:
            p.grad = None
        self._grad_norm = None

    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """The fp32 L2 norm of all main gradients, clipped to `max_norm` by colo.clipping's rule (None:
        no clip); a norm that is not finite leaves them as they are, and step() then skips."""
        norm = float(torch.linalg.vector_norm(self.grad_flat, dtype=torch.float32))
        clip_([self.grad_flat], norm, max_norm)
        self._grad_norm = norm
        return norm

    @torch.no_grad()
    def step(self) -> None:
        """Step the inner optimizer on the masters, then round them into the 16-bit parameters in place;
        with gradients that are not finite, nothing (see _finite_step)."""
        if not self._finite_step():
            return
        self.optimizer.step()
        self._write_params()

    def _write_params(self) -> None:
        masters = torch._foreach_mul(self.masters, self.param_scales) if self.param_scales else self.masters
        self.rounding.write([p.data for p in self.params], masters)

    def state_dict(self) -> dict:
        """The inner optimizer's state and the fp32 master weights (what resuming needs exactly), and the
        stochastic rounding's random state."""
        return {"optimizer": self.optimizer.state_dict(), "master_weights": self.master_flat.detach().clone(),
                **self.rounding.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        masters = state.get("master_weights") if isinstance(state, dict) else None
        if not isinstance(masters, torch.Tensor) or masters.shape != self.master_flat.shape:
            raise ValueError(f"not a MasterWeightOptimizer state for these parameters (expected master_weights of "
                             f"shape {tuple(self.master_flat.shape)})")
        self.optimizer.load_state_dict(state["optimizer"])
        self.rounding.load_state_dict(state)
        with torch.no_grad():
            self.master_flat.copy_(masters)
            self._write_params()

ROUNDINGS = ("nearest", "stochastic")


class MasterRounding:
    """How fp32 masters are written into their 16-bit parameters: rounded to nearest (even), or, for bf16,
    stochastically: each value rounded up with the probability of its distance from the bf16 value below,
    so the served weight is the master in expectation. At a small learning rate an update is a fraction of
    a bf16 step (at 1e-5, a weight of 0.05 moves 1/25 of one), and rounding to nearest serves the old
    weight until the master has drifted half a step away; stochastic rounding serves the drift as it comes.
    fp16 parameters are rounded to nearest either way.

    The random bits of the k-th write of parameter i are drawn from a generator seeded with (seed, k, i), so
    they depend on neither the process nor how the parameters are sharded: data-parallel replicas round
    alike, ZeRO-1's ranks round their pieces as one process would, and a restored state (`writes`) repeats
    the last write's draw, giving back the weights as they were saved."""

    def __init__(self, mode: str = "nearest", seed: int = 0):
        if mode not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {mode!r}")
        self.mode, self.seed = mode, seed
        self.writes = 0   # stochastic writes so far

    def write(self, params: list[torch.Tensor], masters: list[torch.Tensor], pieces=None) -> None:
        """Round `masters` into `params`; pieces: (parameter index, offset, the parameter's numel) of each
        pair where they are pieces of parameters (ZeRO-1's shards), else each pair is parameter i whole."""
        if self.mode == "nearest":
            torch._foreach_copy_(params, masters)
            return
        self.writes += 1
        for i, (param, master) in enumerate(zip(params, masters)):
            if param.dtype != torch.bfloat16:
                param.copy_(master)
                continue
            index, offset, numel = pieces[i] if pieces is not None else (i, 0, param.numel())
            generator = torch.Generator(param.device).manual_seed(hash((self.seed, self.writes, index)) & (2 ** 63 - 1))
            noise = torch.randint(0, 1 << 16, (numel,), dtype=torch.int32, device=param.device, generator=generator)
            # bf16 is the top half of fp32's bits: add a random 16-bit number to the bottom half, then cut it
            # off (the carry rounds up with the right probability; for negative values, away from zero alike).
            bits = master.contiguous().view(torch.int32)
            noise = noise[offset:offset + bits.numel()].view(bits.shape)
            param.copy_(((bits + noise) & -65536).view(torch.float32))   # exact: the low bits are zero

    def state_dict(self) -> dict:
        return {"rounding_writes": self.writes} if self.mode == "stochastic" else {}

    def load_state_dict(self, state: dict) -> None:
        """Before the write that restores the saved masters: it draws what the saved weights were drawn with."""
        if self.mode == "stochastic" and "rounding_writes" in state:
            self.writes = int(state["rounding_writes"]) - 1


def checked_params(groups: list[dict], owner: str, dtypes) -> list[torch.Tensor]:
    """The parameters of `groups`, in order; TypeError/ValueError naming the first one that is not a
    tensor of `dtypes` requiring grad, or that appears twice."""
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise ValueError(f"{owner} got no parameters")
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor) or p.dtype not in dtypes:
            names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"parameter {i}: {owner} keeps fp32 masters of {names} parameters, got "
                            f"{getattr(p, 'dtype', type(p).__name__)}"
                            + ("; train fp32 parameters with the optimizer directly" if torch.float32 not in dtypes else ""))
        if not p.requires_grad:
            raise ValueError(f"parameter {i} does not require grad")
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"a parameter appears twice in {owner}'s parameters")
    return params


def param_groups(params) -> list[dict]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


def fp32_buffer(region, numel: int, device) -> torch.Tensor:
    """A flat fp32 buffer of `numel` elements in `region` (None: allocated by torch on `device`)."""
    if region is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    return region.empty((numel,), torch.float32)
