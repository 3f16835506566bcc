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
from functools import partial

import torch

NOT_ROUTED = -1


def moe_runners(model) -> list:
    """The engine's MoE layers (vLLM's MoERunner modules), in layer order."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)


class RoutedExpertsCapture:
    """Worker-side: every request's routed experts, captured at each engine step (the CPU path)."""

    def __init__(self, model, vllm_config):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runners = moe_runners(model)
        self.layers = [runner.layer_id for runner in runners]
        self.top_k = vllm_config.model_config.get_num_experts_per_tok()
        tokens = vllm_config.scheduler_config.max_num_batched_tokens
        device = next(model.parameters()).device
        self.buffer = torch.full((tokens, len(runners), self.top_k), NOT_ROUTED, dtype=torch.int32, device=device)
        for column, runner in enumerate(runners):
            if not isinstance(runner.router, BaseRouter):
                raise NotImplementedError(f"{runner.layer_name}: its router ({type(runner.router).__name__}) does not "
                                          "report the experts it picks; routing replay cannot follow it")
            runner.router.set_capture_fn(partial(_write, self.buffer, column))
        self.by_request: dict[str, torch.Tensor] = {}
        self.recording = False   # off: nothing is kept (routes nobody asked for would pile up)

    def record(self, scheduler_output, req_ids: list[str]) -> None:
        """After an engine step: each scheduled request's rows, at the positions it was computing."""
        if not self.recording:
            return
        start_of = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        start_of.update(zip(cached.req_ids, cached.num_computed_tokens))
        row = 0
        for req_id in req_ids:
            count = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not count:
                continue
            start = start_of[req_id]
            held = self.by_request.get(req_id)
            if held is None or held.shape[0] < start + count:
                grown = torch.full((max(start + count, 2 * (0 if held is None else held.shape[0])), len(self.layers),
                                    self.top_k), NOT_ROUTED, dtype=torch.int16)
                if held is not None:
                    grown[:held.shape[0]] = held
                held = self.by_request[req_id] = grown
            held[start:start + count] = self.buffer[row:row + count].to("cpu", torch.int16)
            row += count

    def pop(self, req_id: str, positions: int) -> torch.Tensor:
        """The request's routes for its first `positions` positions (-1 where none were computed)."""
        held = self.by_request.pop(req_id, None)
        out = torch.full((positions, len(self.layers), self.top_k), NOT_ROUTED, dtype=torch.int16)
        if held is not None:
            n = min(positions, held.shape[0])
            out[:n] = held[:n]
        return out

    def take_all(self) -> dict[str, torch.Tensor]:
        """Every request's routes held, in the order the requests were made (vLLM numbers them), emptied."""
        held, self.by_request = self.by_request, {}
        return dict(sorted(held.items(), key=lambda item: _request_order(item[0])))


def _request_order(req_id: str) -> tuple[int, int]:
    """(the request's number, the sample's index) of an engine id: "N-xxxxxxxx", or "I_N-xxxxxxxx" for
    sample I of a request with several (vllm/v1/engine/parallel_sampling.py)."""
    index, _, rest = req_id.partition("_") if "_" in req_id.split("-")[0] else ("0", "", req_id)
    number = rest.split("-")[0]
    return (int(number) if number.isdigit() else -1, int(index) if index.isdigit() else 0)


def _write(buffer: torch.Tensor, column: int, topk_ids: torch.Tensor) -> None:
    buffer[:topk_ids.shape[0], column].copy_(topk_ids)


def install_capture(model, vllm_config) -> RoutedExpertsCapture | None:
    """colo's worker, at load (before compilation): a capture for a MoE model on a platform where vLLM's
    own does not run; None otherwise."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not moe_runners(model):
        return None
    return RoutedExpertsCapture(model, vllm_config)


@contextlib.contextmanager
def recording_routes(llm):
    """Inside, the engine keeps each request's routes (colo's capture; vLLM's own returns them with the
    outputs); outside, none is kept. Yields the capture (None where there is none)."""
    from .engine import engine_placement

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
    from .engine import engine_placement

    completions = sorted(output.outputs, key=lambda c: c.index)
    prompt = len(output.prompt_token_ids or ())
    placement = engine_placement(llm)
    capture = getattr(placement, "routing", None) if placement is not None else None
    if capture is None:
        found = [getattr(c, "routed_experts", None) for c in completions]
        return [None if r is None else torch.as_tensor(r).to(torch.int16) for r in found]
    names = [internal_id] if len(completions) == 1 else [f"{c.index}_{internal_id}" for c in completions]
    return [capture.pop(name, prompt + max(len(c.token_ids) - 1, 0)) for name, c in zip(names, completions)]
