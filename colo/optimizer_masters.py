"""fp32 master weights for an optimizer someone else built (TRL's and transformers' Trainer build
theirs in `create_optimizer`), without replacing it.

    optimizer = trainer.create_optimizer()               # over the model's bf16 parameters
    FP32Masters(optimizer, {param: fp32_tensor, ...})    # now it steps fp32 masters of them

The optimizer object stays the one its owner knows (LR schedulers, `accelerate`'s wrapper and
checkpoint code keep their references): its param groups are given the fp32 masters in place of the
16-bit parameters, before its first step. Hooks on the optimizer then, at each `step()`, hand the
parameters' gradients to the masters in fp32, and afterwards round the masters into the parameters
in place (their addresses stay: an engine sharing them serves the update). The gradients themselves
stay the parameters' own (16-bit, accumulated by autograd), so the owner's gradient clipping and
zeroing keep working unchanged. `state_dict()` carries the masters and `load_state_dict()` restores
them (from a state without them, e.g. one saved before, the masters are taken from the parameters).
A step on gradients that are not finite is skipped (colo.clipping.NonFiniteStepGuard: masters and
parameters stay as they were, `skipped_steps` counts it), so an engine sharing them never serves NaN.

scales: {parameter: s} for parameters that hold s times their master (a LoRA B in vLLM's adapter
slot holds alpha/rank x PEFT's B; colo.lora): the step writes s x master into them. Their gradients
must already be in the master's units (colo.lora's PEFT adapter scales them as autograd makes them).
"""
from __future__ import annotations

import torch

from .clipping import refuse_non_finite_steps

MASTERS_KEY = "colo_fp32_masters"


class FP32Masters:
    """Give `optimizer` (not stepped yet) fp32 masters: `masters` maps each 16-bit parameter in its
    param groups to an fp32 tensor of the same shape (e.g. the parameter's fp32 values before it was
    cast), which becomes the optimizer's parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: dict[torch.Tensor, torch.Tensor],
                 scales: dict[torch.Tensor, float] | None = None):
        if optimizer.state:
            raise ValueError("FP32Masters needs an optimizer that has not stepped yet (its state would be "
                             "keyed by the 16-bit parameters)")
        by_id = {id(p): m for p, m in masters.items()}
        self.params, self.masters = [], []
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                master = by_id.get(id(p))
                if master is None:
                    raise ValueError(f"no fp32 master for an optimizer parameter of shape {tuple(p.shape)}")
                if master.dtype != torch.float32 or master.shape != p.shape:
                    raise ValueError(f"the master of a parameter of shape {tuple(p.shape)} is {master.dtype} "
                                     f"{tuple(master.shape)}, not float32 of the same shape")
                master.requires_grad_(True)
                self.params.append(p)
                self.masters.append(master)
                group["params"][i] = master
        scale_of = {id(p): float(v) for p, v in (scales or {}).items()}
        self.scales = [scale_of.get(id(p), 1.0) for p in self.params]
        self.optimizer = optimizer
        self._handles = [optimizer.register_step_pre_hook(self._gradients_to_masters),
                         optimizer.register_step_post_hook(self._masters_to_params),
                         optimizer.register_state_dict_post_hook(self._save_masters),
                         optimizer.register_load_state_dict_pre_hook(self._load_masters)]
        # After _gradients_to_masters, so that it checks the gradients the masters are given.
        self.guard = refuse_non_finite_steps(optimizer)

    @property
    def skipped_steps(self) -> int:
        """Steps refused because the gradients were not finite."""
        return self.guard.skipped_steps

    def _gradients_to_masters(self, optimizer, args, kwargs) -> None:
        for p, master in zip(self.params, self.masters):
            if p.grad is None:
                master.grad = None
            elif master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.copy_(p.grad)

    @torch.no_grad()
    def _masters_to_params(self, optimizer, args, kwargs) -> None:
        self._write_params()
        for master in self.masters:
            master.grad = None  # 4 bytes per parameter, needed again only at the next step

    def _save_masters(self, optimizer, state_dict: dict) -> dict:
        state_dict[MASTERS_KEY] = [m.detach().clone() for m in self.masters]
        return state_dict

    @torch.no_grad()
    def _load_masters(self, optimizer, state_dict: dict) -> dict:
        saved = state_dict.pop(MASTERS_KEY, None)
        if saved is None:  # a state saved without masters: the parameters hold the best values there are
            saved = [p.detach().float() / s for p, s in zip(self.params, self.scales)]
        if len(saved) != len(self.masters) or any(s.shape != m.shape for s, m in zip(saved, self.masters)):
            raise ValueError(f"the optimizer state's fp32 masters do not match this model's parameters "
                             f"({len(saved)} tensors for {len(self.masters)} parameters)")
        for master, value in zip(self.masters, saved):
            master.copy_(value)
        self._write_params()
        return state_dict

    def _write_params(self) -> None:
        """Round the masters (times their scales) into the parameters, in place."""
        scaled = any(s != 1.0 for s in self.scales)
        masters = torch._foreach_mul(self.masters, self.scales) if scaled else self.masters
        torch._foreach_copy_([p.data for p in self.params], masters)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.guard.remove()
