"""The experts a MoE engine routed each token to, per request: what routing replay (colo.moe_routing)
makes the trainer use.

vLLM 0.32 returns them itself (`enable_return_routed_experts=True`, `CompletionOutput.routed_experts`
[positions, layers, top_k]) only with Model Runner V2, which needs Triton: on these CPUs it refuses. So
where vLLM cannot, colo's worker captures them through the same hook vLLM's own capture uses, each MoE
layer's router's `set_capture_fn` (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py):
installed at load, before the engine is compiled, it writes each forward's expert ids into a buffer
(an in-place copy the compiled graph keeps), and after each engine step the worker hands every
scheduled request its tokens' rows, at the positions the scheduler computed. `routed_experts` gives
the same thing either way: one int16 tensor [positions, MoE layers, top_k] per completion, for the
prompt and the completion but its last token (the ones the engine ran through the model).

Positions the engine did not compute (a prompt prefix its cache served) read -1: routing replay builds
its engines without a prefix cache.
"""

from __future__ import annotations

import contextlib

import torch

from .engine_access import engine_placement


@contextlib.contextmanager
def recording_routes(llm):
    """Inside, the engine keeps each request's routes (colo's capture; vLLM's own returns them with the
    outputs); outside, none is kept. Yields the capture (None where there is none)."""
    placement = engine_placement(llm)
    capture = getattr(placement, "routing", None) if placement is not None else None
    if capture is None:
        yield None
        return
    capture.by_request.clear()
    capture.recording = True
    try:
        yield capture
    finally:
        capture.recording = False
        capture.by_request.clear()


def engine_routing_options(device_type: str) -> dict:
    """What a MoE engine needs for its routes to be returned: vLLM's own capture on a GPU, no prefix
    cache anywhere (a prefix served from the cache was not routed again)."""
    options = {"enable_prefix_caching": False}
    if device_type != "cpu":
        options["enable_return_routed_experts"] = True
    return options


def routed_experts(llm, output, internal_id: str) -> list[torch.Tensor | None]:
    """One [positions, MoE layers, top_k] int16 tensor per completion of `output` (a vLLM RequestOutput;
    `internal_id` the engine's id of its request, as LLM.enqueue returned it), in completion order; None
    for a model without MoE layers or an engine that captured nothing."""
    completions = sorted(output.outputs, key=lambda c: c.index)
    prompt = len(output.prompt_token_ids or ())
    placement = engine_placement(llm)
    capture = getattr(placement, "routing", None) if placement is not None else None
    if capture is None:
        found = [getattr(c, "routed_experts", None) for c in completions]
        return [None if r is None else torch.as_tensor(r).to(torch.int16) for r in found]
    names = [internal_id] if len(completions) == 1 else [f"{c.index}_{internal_id}" for c in completions]
    return [capture.pop(name, prompt + max(len(c.token_ids) - 1, 0)) for name, c in zip(names, completions)]
