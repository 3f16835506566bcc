"""Routing replay: the trainer's MoE layers route each token to the experts the engine routed it to.

The engine and the trainer compute a MoE router's logits with different kernels, so where two experts'
scores are close they pick different ones: the trainer then computes the log-probability of a sample
through experts that never produced it. With replay, the trainer takes the engine's choice of experts
(colo.vllm_compat.routing captures it per token) and computes the gate weights of those experts from
its own router logits, as its router would have for them, so the router still learns through the
chosen experts' gates.

    replay = RouterReplay.attach(hf_model)        # once: a hook on each MoE layer's router
    with replay.forcing(routes):                  # routes [batch, seq, MoE layers, top_k], -1: free
        logp = model(...)                         # forward (and backward) under the engine's routing
    replay.stats()                                # router mismatch: share of tokens whose top-k differed

`measuring(routes)` leaves the routing alone and only counts the mismatch (replay off). A router is a
transformers module returning (router_logits, routing_weights, expert_indices) (Qwen2/3-MoE, Mixtral,
OLMoE, GPT-OSS, DeepSeek-V2), or Llama 4's (scores over every expert, 0 where not chosen; router_logits)
with its `top_k`; how its weights follow from its logits is read off its own output the first time it
runs (softmax, then top-k, renormalized or not; top-k, then softmax; top-k, then sigmoid) and applied to
the engine's experts. A router whose weights follow none of these (DeepSeek's grouped, biased sigmoid)
is refused by name.
"""
from __future__ import annotations

import contextlib

import torch

NOT_ROUTED = -1
_RULES = ("softmax-topk", "softmax-topk-renormalized", "topk-softmax", "topk-sigmoid")


def router_modules(model) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router module) of every MoE layer of a transformers model, in layer order."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        # (transformers names a router `gate`, GPT-OSS's `router`)
        if "Router" in type(module).__name__ and "layers" in parts and parts[-1] in ("gate", "router"):
            found.append((int(parts[parts.index("layers") + 1]), module))
    return sorted(found, key=lambda item: item[0])


def is_moe(model) -> bool:
    return bool(router_modules(model))


class RouterReplay:
    """Hooks on a transformers model's MoE routers (see the module docstring)."""

    def __init__(self, routers: list[tuple[int, torch.nn.Module]]):
        self.layers = [layer for layer, _ in routers]
        self._routes: torch.Tensor | None = None   # [tokens, MoE layers, top_k] of the running forward
        self._force = False
        self._rules: dict[int, str] = {}
        self.compared = self.differed = 0
        self.forced = 0   # (token, MoE layer) pairs routed to the engine's experts so far
        self._handles = [module.register_forward_hook(self._hook(column, layer))
                         for column, (layer, module) in enumerate(routers)]

    @classmethod
    def attach(cls, model) -> "RouterReplay":
        replay = getattr(model, "colo_router_replay", None)
        if replay is None:
            routers = router_modules(model)
            if not routers:
                raise ValueError(f"{type(model).__name__} has no MoE layers: there is no routing to replay")
            replay = cls(routers)
            model.colo_router_replay = replay
        return replay

    @contextlib.contextmanager
    def forcing(self, routes: torch.Tensor | None):
        """Forward and backward inside route each token as `routes` says ([batch, seq, MoE layers, top_k];
        -1 rows: the trainer's own choice)."""
        with self._using(routes, force=True):
            yield

    @contextlib.contextmanager
    def measuring(self, routes: torch.Tensor | None):
        """As forcing, but only counting where the trainer's choice differs from `routes`."""
        with self._using(routes, force=False):
            yield

    @contextlib.contextmanager
    def _using(self, routes, force: bool):
        if routes is not None and routes.shape[-2] != len(self.layers):
            raise ValueError(f"routes hold {routes.shape[-2]} MoE layers, the trainer's model has {len(self.layers)}")
        outer = self._routes, self._force   # a forcing inside another (a micro-batch of a step) restores it
        self._routes = None if routes is None else routes.reshape(-1, routes.shape[-2], routes.shape[-1])
        self._force = force
        try:
            yield
        finally:
            self._routes, self._force = outer

    def stats(self, reset: bool = True) -> dict:
        """{"router_mismatch": share of (token, MoE layer) pairs whose experts differed, "router_compared": the
        pairs compared}; reset the counts."""
        out = {"router_mismatch": self.differed / self.compared if self.compared else 0.0,
               "router_compared": self.compared}
        if reset:
            self.compared = self.differed = 0
        return out

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, column: int, layer: int):
        def hook(module, args, output):
            if self._routes is None:
                return None
            read = _read_router_output(output, getattr(module, "top_k", None))
            if read is None:
                if self._force:  # asked to replay, which this router's output does not allow: said, not skipped
                    raise NotImplementedError(
                        f"layer {layer}: routing replay needs a router returning (router_logits, routing_weights, "
                        f"expert_indices), or (scores over every expert, router_logits) with a top_k; "
                        f"{type(module).__name__} returns "
                        f"{f'{len(output)} values' if isinstance(output, tuple) else type(output).__name__}")
                return None  # measuring only: nothing to compare (router_compared stays 0)
            logits, weights, indices, dense = read
            engine = self._routes[:, column].to(indices.device, torch.long)
            if engine.shape[0] != indices.shape[0]:
                raise ValueError(f"layer {layer}: the routes hold {engine.shape[0]} tokens, the forward {indices.shape[0]}")
            routed = engine[:, 0] >= 0
            if torch.is_grad_enabled():  # the policy's forward (a reference model's is not counted)
                mine, theirs = indices.sort(-1).values, engine.sort(-1).values
                self.compared += int(routed.sum())
                self.differed += int(((mine != theirs).any(-1) & routed).sum())
            if not self._force:
                return None
            rule = self._rules.get(column) or self._rules.setdefault(column, _rule_of(logits, weights, indices, layer))
            chosen = torch.where(routed.unsqueeze(-1), engine, indices)
            self.forced += int(routed.sum())
            gates = _weights(rule, logits, chosen).to(weights.dtype)
            if dense:
                return torch.zeros(logits.shape, dtype=weights.dtype, device=logits.device).scatter(-1, chosen, gates), logits
            return logits, gates, chosen
        return hook


def _read_router_output(output, top_k: int | None):
    """(router_logits, the chosen experts' weights, the chosen experts, whether the router returns its
    weights over every expert) of one router output, or None where it is neither form the module
    docstring names. Llama 4's router chooses the top_k of its logits and returns their scores, 0 elsewhere."""
    if isinstance(output, tuple) and len(output) == 3:
        logits, weights, indices = output
        return logits, weights, indices, False
    if isinstance(output, tuple) and len(output) == 2 and isinstance(top_k, int) and \
            all(isinstance(t, torch.Tensor) for t in output) and output[0].shape == output[1].shape:
        scores, logits = output
        indices = logits.topk(top_k, dim=-1).indices
        return logits, scores.gather(-1, indices), indices, True
    return None


def _weights(rule: str, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    if rule == "topk-softmax":
        return torch.softmax(logits.float().gather(-1, indices), dim=-1)
    if rule == "topk-sigmoid":
        return torch.sigmoid(logits.float().gather(-1, indices))
    picked = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    return picked / picked.sum(-1, keepdim=True) if rule == "softmax-topk-renormalized" else picked


def _rule_of(logits, weights, indices, layer: int) -> str:
    """How this router's weights follow from its logits and its experts, read off one of its outputs."""
    # Within the rounding of the dtype the router returns its weights in (bf16: 2^-8); the rules differ by
    # far more (a factor of the chosen experts' total probability).
    tolerance = 4 * torch.finfo(weights.dtype).eps
    with torch.no_grad():
        for rule in _RULES:
            if torch.allclose(_weights(rule, logits, indices), weights.float(), rtol=tolerance, atol=tolerance):
                return rule
    raise NotImplementedError(f"layer {layer}: its router's weights are not a softmax of its logits over the chosen "
                              "experts (renormalized or not) nor their sigmoid; routing replay cannot recompute them "
                              "for the engine's experts")


def replay_of(model) -> RouterReplay | None:
    """The RouterReplay attached to the trainer's `model`, or to the Hugging Face model a trainer object
    runs (a tensor-parallel model's `hf_model`); None where none is."""
    for candidate in (model, getattr(model, "hf_model", None)):
        replay = getattr(candidate, "colo_router_replay", None) if candidate is not None else None
        if isinstance(replay, RouterReplay):
            return replay
    return None
