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
transformers module returning its scores over every expert, the chosen experts' weights and their
indices, in any order (RouterOutput.read), or Llama 4's (scores over every expert, 0 where not chosen;
router_logits) with its `top_k`. How its weights follow from its scores is read off its own output the
first time it runs (_rule_of: a softmax over every expert or over the chosen, a sigmoid, or the scores
themselves; renormalized or not; times the router's own scale or not) and applied to the engine's
experts. A router whose weights follow none of these is refused by name.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

NOT_ROUTED = -1


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
            read = RouterOutput.read(output, getattr(module, "top_k", None))
            if read is None:
                if self._force:  # asked to replay, which this router's output does not allow: said, not skipped
                    raise NotImplementedError(
                        f"layer {layer}: routing replay needs a router returning its scores over every expert, "
                        f"the chosen experts' weights and their indices (in any order), or (scores over every "
                        f"expert, router_logits) with a top_k; {type(module).__name__} returns "
                        f"{f'{len(output)} values' if isinstance(output, tuple) else type(output).__name__}")
                return None  # measuring only: nothing to compare (router_compared stays 0)
            indices = read.indices
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
            rule = self._rules.get(column) or self._rules.setdefault(column, _rule_of(read, module, layer))
            chosen = torch.where(routed.unsqueeze(-1), engine, indices)
            self.forced += int(routed.sum())
            return read.rebuilt(_weights(rule, read.scores, chosen, module).to(read.weights.dtype), chosen)
        return hook


@dataclasses.dataclass
class RouterOutput:
    """One router output, read: `scores` over every expert [tokens, experts] (its logits, or Llama 4's
    and Gemma 4's kinds of them), the chosen experts' `weights` and their `indices` [tokens, top_k]."""
    scores: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    output: tuple
    positions: tuple[int, int, int] | None   # where scores, weights, indices sit in the output; None: Llama 4's

    @classmethod
    def read(cls, output, top_k: int | None) -> "RouterOutput | None":
        """Transformers' three tensors in any order (Qwen-MoE's (logits, weights, indices), GraniteMoE's
        (indices, weights, logits)), or Llama 4's (its chosen experts' scores over every expert, 0
        elsewhere; logits) with the router's top_k; None where it is neither."""
        if not isinstance(output, tuple) or not all(isinstance(t, torch.Tensor) for t in output):
            return None
        if len(output) == 3:
            integer = [i for i, t in enumerate(output) if not t.is_floating_point()]
            if len(integer) != 1:
                return None
            k = integer[0]
            floats = [i for i in range(3) if i != k]
            same = [i for i in floats if output[i].shape == output[k].shape]
            if len(same) != 1:
                return None
            w = same[0]
            (s,) = [i for i in floats if i != w]
            return cls(output[s], output[w], output[k], output, (s, w, k))
        if len(output) == 2 and isinstance(top_k, int) and output[0].shape == output[1].shape:
            dense, logits = output
            indices = logits.topk(top_k, dim=-1).indices
            return cls(logits, dense.gather(-1, indices), indices, output, None)
        return None

    def rebuilt(self, weights: torch.Tensor, indices: torch.Tensor) -> tuple:
        """The router's output choosing `indices` with `weights`, in its own form."""
        if self.positions is None:
            dense = torch.zeros(self.scores.shape, dtype=weights.dtype, device=weights.device)
            return dense.scatter(-1, indices, weights), self.scores
        out = list(self.output)
        s, w, k = self.positions
        out[w], out[k] = weights, indices.to(self.indices.dtype)
        return tuple(out)


# How a router's weights follow from its scores over every expert and the chosen experts: the chosen
# experts' softmax over every expert, their softmax among themselves, their sigmoid, or the scores
# themselves (probabilities already: Gemma 4's); renormalized over the chosen or not; times the
# router's own scale or not (DeepSeek-V3's `routed_scaling_factor`, Gemma 4's `per_expert_scale`).
_BASES = ("softmax", "softmax over the chosen", "sigmoid", "probabilities")
_SCALES = (None, "routed_scaling_factor", "per_expert_scale")


def _weights(rule: tuple, scores: torch.Tensor, indices: torch.Tensor, module) -> torch.Tensor:
    base, renormalized, scale = rule
    scores = scores.float()
    if base == "softmax":
        weights = torch.softmax(scores, dim=-1).gather(-1, indices)
    elif base == "softmax over the chosen":
        weights = torch.softmax(scores.gather(-1, indices), dim=-1)
    elif base == "sigmoid":
        weights = torch.sigmoid(scores.gather(-1, indices))
    else:
        weights = scores.gather(-1, indices)
    if renormalized:
        weights = weights / weights.sum(-1, keepdim=True)
    if scale == "routed_scaling_factor":
        weights = weights * float(module.routed_scaling_factor)
    elif scale == "per_expert_scale":
        weights = weights * module.per_expert_scale[indices]
    return weights


def _rule_of(read: RouterOutput, module, layer: int) -> tuple:
    """How this router's weights follow from its scores and its experts, read off one of its outputs."""
    # Within the rounding of the dtype the router returns its weights in (bf16: 2^-8); the rules differ by
    # far more (a factor of the chosen experts' total probability, a sigmoid against a softmax).
    tolerance = 4 * torch.finfo(read.weights.dtype).eps
    # (the router's own scale first: at 1, as a new model's may be, the unscaled rule matches too)
    scales = [s for s in _SCALES if s is not None and isinstance(getattr(module, s, None), (int, float, torch.Tensor))]
    scales.append(None)
    with torch.no_grad():
        for scale in scales:
            for base in _BASES:
                for renormalized in (False, True):
                    rule = (base, renormalized, scale)
                    weights = _weights(rule, read.scores, read.indices, module)
                    if torch.allclose(weights, read.weights.float(), rtol=tolerance, atol=tolerance):
                        return rule
    raise NotImplementedError(f"layer {layer}: its router's weights ({type(module).__name__}) are no softmax, sigmoid "
                              "or probabilities of its scores over the chosen experts (renormalized or not, scaled "
                              "or not); routing replay cannot recompute them for the engine's experts")


def replay_of(model) -> RouterReplay | None:
    """The RouterReplay attached to the trainer's `model`, or to the Hugging Face model a trainer object
    runs (a tensor-parallel model's `hf_model`); None where none is."""
    for candidate in (model, getattr(model, "hf_model", None)):
        replay = getattr(candidate, "colo_router_replay", None) if candidate is not None else None
        if isinstance(replay, RouterReplay):
            return replay
    return None
