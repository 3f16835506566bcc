"""TRL's MoE load-balancing loss (`router_aux_loss_coef`): the loss a MoE family's own forward computes
from its router logits (transformers' `load_balancing_loss_func`, Switch Transformer's: the experts'
share of tokens times their mean router probability), weighted and added to the policy loss, so the
routers keep spreading tokens over the experts while the policy trains. TRL adds it by default for
models whose config has `output_router_logits`, with the config's `router_aux_loss_coef`; colo too.

Families whose forward computes none (Llama 4's, DeepSeek-V3's bias-balanced routers) add nothing, as
with TRL's models' own forwards; an explicit weight for such a model is refused.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class RouterAuxLoss:
    coef: float
    loss: Callable[[tuple, torch.Tensor], torch.Tensor]   # (router logits per MoE layer, attention mask) -> scalar


def router_aux_loss(model, coef: float | None) -> RouterAuxLoss | None:
    """The load-balancing loss `model` trains with (None: none): weighted by `coef`, or where None by its
    config's router_aux_loss_coef. A ValueError where `coef` asks for one the model does not compute."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    asked = coef is not None
    if not asked:
        coef = float(getattr(text, "router_aux_loss_coef", None) or 0.0) if hasattr(text, "output_router_logits") else 0.0
    if not coef:
        return None
    function = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if not hasattr(text, "output_router_logits") or function is None or experts is None or top_k is None:
        if asked:
            raise ValueError(f"router_aux_loss_coef={coef}: {type(model).__name__} computes no load-balancing loss "
                             "from router logits (a dense model, or a MoE family whose routers balance without one)")
        return None
    return RouterAuxLoss(coef, lambda logits, mask: function(logits, experts, top_k, mask))
