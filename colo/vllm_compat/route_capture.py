"""colo's capture of the experts a MoE engine routes each token to, in its worker (colo.vllm_compat.routing
says why and when): each MoE layer's router's `set_capture_fn` hook, installed at load, writes every
forward's expert ids into a buffer; after each engine step the worker hands every scheduled request its
tokens' rows. Nothing here imports the engine side: the worker (colo.vllm_compat.worker) installs it.
"""
from __future__ import annotations

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
