"""The worker hook: colo's worker places the engine's memory in a colo.Pool while vLLM allocates it,
and runs the engine's GPU work on the pool's high-priority stream.

`ColoWorker`, a subclass of the platform's own worker (passed to vLLM as `worker_cls`, by the dotted
name `placing` yields), answers vLLM's `_maybe_get_memory_pool_context(tag)`: tag "weights" (around
`load_model`) places the engine's parameters in the pool's `weights` region, tag "kv_cache" (around the
KV cache allocation, on both model runners) places the KV cache in the `kv_cache` region. The same
`colo.placement.AllocateIn` mode does it on the host and on a GPU.

On a GPU, vLLM computes on torch's current stream of the thread that steps it (both model runners;
V1 makes side streams only for copies, V2 caches the stream it first sees as `main_stream`). Left
alone that is the default stream, of the same (lowest) priority as colo's `train` stream, so during an
overlapped step the trainer's large matmuls and the latency-bound decode tail compete as equals. The
worker's steps (`execute_model`, `sample_tokens`, the warm-up that captures CUDA graphs) therefore run
on the pool's `infer` stream, the highest priority, entered with torch.cuda.set_stream (vLLM records a
thread's stream through it: vllm.utils.torch_utils) after it waits for the caller's stream, which waits
for it again on the way out (colo.pool.Stream.as_current); V2's `main_stream` is that stream. CUDA graphs are captured on a stream of
vLLM's own (parallel_state.graph_capture) and torch instantiates them with each node's capture-time
priority, so colo.engine sets CUDA_GRAPHS_USE_NODE_PRIORITY=0, before CUDA starts, for graph kernels to
take the priority of the stream they are replayed on (colo.engine.prioritize_graph_replays).
"""
from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import threading

import torch

from ..placement import AllocateIn, adopt_into
from ..regions import KV_CACHE, WEIGHTS, WEIGHTS_CHUNK_BYTES, region_for
from ..sizes import round_up
from .route_capture import install_capture
from .trainer_models import remember_engine_config
from .cpu_gemm import (CpuLinear, CpuPackedConv, CpuPackedExperts, _keep_conv_weights, _keep_expert_weights,
                       _keep_linear_weights, _LoadMode)


class EnginePlacement:
    """Where one engine's memory goes, and what colo learned while vLLM loaded it.

    pool: the colo.Pool; `weights` and `kv_cache` regions are created in it on first use.
    After loading: `linears` (one CpuLinear per CPU linear layer, one CpuPackedExperts per MoE weight the
    CPU MoE kernel packed, one CpuPackedConv per causal-conv1d weight its conv kernel packed; empty on a
    GPU), `kept` ({id(served packed tensor): the weights as loaded,
    which colo keeps for trainers to view}), `adopted_bytes`
    (parameters vLLM made outside torch's factories, copied into the region once, before any
    compilation), `placed_bytes`, and what the weights region holds, apart: `model_bytes` (the
    model's parameters and buffers) and `runtime_bytes` (everything else the model runner allocated
    inside vLLM's "weights" hook: Model Runner V2 builds its sampler, model state and structured-output
    buffers there, after the model; they stay in the region beside the weights, counted here).
    """

    def __init__(self, pool):
        self.pool = pool
        self.linears: list[CpuLinear | CpuPackedExperts | CpuPackedConv] = []
        self.kept: dict[int, torch.Tensor] = {}
        self.adopted_bytes = 0
        self.placed_bytes = 0
        self.model_bytes = 0
        self.runtime_bytes = 0
        self.loaded = False
        self.wake_on_demand = True  # colo.engine: work reaching a sleeping KV cache wakes it
        self.routing = None         # a MoE model's routed experts, captured per request (.routing)

    def weights_region(self, nbytes: int = 0):
        # No budget yet: what the pool has left, fitted to what the model used once it is loaded; in
        # chunks sized for weights, not for that budget (regions.WEIGHTS_CHUNK_BYTES says why).
        return self.pool.regions.get(WEIGHTS) or self.pool.region(WEIGHTS, chunk_bytes=WEIGHTS_CHUNK_BYTES)

    def kv_cache_region(self, nbytes: int):
        return region_for(self.pool, KV_CACHE, nbytes)

    @contextlib.contextmanager
    def loading_weights(self, worker):
        if WEIGHTS in self.pool.regions:  # a rebuild: the fitted budget may be short of load-time scratch
            self.pool.regions[WEIGHTS].grow_budget()
        mode = _LoadMode(self.weights_region, self.pool.device)
        with mode:
            yield
        model = worker.model_runner.get_model()
        vllm_config = getattr(worker, "vllm_config", None)
        self.routing = install_capture(model, vllm_config) if vllm_config is not None else None  # before compiling
        repacked = [*_keep_expert_weights(model, mode), *_keep_conv_weights(model)]
        self.linears = [*_keep_linear_weights(model, mode), *repacked]
        self.kept = {id(e.packed): e.weight for e in repacked}
        region = self.weights_region()
        self.adopted_bytes = adopt_into(region, [*model.parameters(), *(e.weight for e in repacked)])
        self.placed_bytes = mode.placed_bytes
        self.model_bytes = _bytes_inside(region, [*model.parameters(), *model.buffers(), *self.kept.values()])
        self.runtime_bytes = max(0, region.stats()["allocated_bytes"] - self.model_bytes)
        region.fit_budget()
        self.loaded = True

    def allocating_kv_cache(self):
        return AllocateIn(self.kv_cache_region, self.pool.device)


def _bytes_inside(region, tensors) -> int:
    """The region's bytes the tensors' storages take, each storage once, with its allocation rounding."""
    spans = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
             if t.numel() and region.contains(t)}
    return sum(round_up(nbytes, region.alignment) for nbytes in spans.values())


_pending = threading.local()
WORKER_CLS = "colo.vllm_compat.worker.ColoWorker"  # what build_llm passes as vLLM's worker_cls


@contextlib.contextmanager
def placing(placement: EnginePlacement):
    """While a vllm.LLM is constructed in this thread, its ColoWorker takes `placement`. Yields the
    worker's dotted name for vLLM's `worker_cls` (vLLM imports the module and reads the attribute:
    `vllm.utils.import_utils.resolve_obj_by_qualname`). It is the class's own module and name, so
    pickle finds the class by the same path."""
    if getattr(_pending, "placement", None) is not None:
        raise RuntimeError("colo is already building an engine in this thread")
    _pending.placement = placement
    try:
        yield WORKER_CLS
    finally:
        _pending.placement = None


def job_init_method(init_method: str) -> str:
    """vLLM's CPU worker names its shared-memory segments after the init method's last ':' part
    (cpu_worker.py: VLLM_DIST_IDENT), which is "env://" for every external_launcher job, so two
    tensor-parallel jobs on one host collide ("create shm in SHMManager failed. errno: 17"). Under
    torchrun, name them after the job: its rendezvous port (unique per concurrent job on a host) and
    run id. The process group exists before the engine starts (colo.grpo, colo.trl), so vLLM reads
    this string for nothing else."""
    port = os.environ.get("MASTER_PORT")
    if init_method != "env://" or port is None or not torch.distributed.is_initialized():
        return init_method
    run_id = "".join(c if c.isalnum() else "-" for c in os.environ.get("TORCHELASTIC_RUN_ID", "none"))
    ident = f"colo-{port}-{run_id}"
    remove_stale_segments(ident, torch.distributed.get_rank())
    return f"env://{ident}"


def remove_stale_segments(ident: str, rank: int, directory: str = "/dev/shm") -> list[str]:
    """Remove the shared-memory segments named after `ident` that global rank `rank` is about to create
    (vLLM's `{ident}-{group}-[{ranks}]-cpushm_{i}`, the i-th of those ranks being this one): a job that
    died with the same rendezvous port left them, and vLLM's create would fail on them ("errno: 17").
    A live job holding the port is this one, and no rank creates another's: none of them is in use."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), glob.escape(ident) + "-*-cpushm_*")):
        match = re.search(r"-\[([0-9-]+)\]-cpushm_([0-9]+)$", path)
        if match is None:
            continue
        ranks, index = [int(r) for r in match.group(1).split("-")], int(match.group(2))
        if index < len(ranks) and ranks[index] == rank:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


class _ColoWorkerMixin:
    def __init__(self, *args, **kwargs):
        placement = getattr(_pending, "placement", None)
        if placement is None:
            raise RuntimeError("colo.vllm_compat.ColoWorker is created by colo.engine.build_llm, in the process "
                               "that builds the engine (it needs the colo.Pool to place memory in)")
        self.colo_placement = placement
        super().__init__(*args, **kwargs)
        self.distributed_init_method = job_init_method(self.distributed_init_method)

    def init_device(self, *args, **kwargs):
        result = super().init_device(*args, **kwargs)
        ensure_expert_group(self.vllm_config)
        remember_engine_config(self.vllm_config)
        return result

    def execute_model(self, *args, **kwargs):
        with self.colo_placement.pool.stream("infer").as_current():
            output = super().execute_model(*args, **kwargs)
        routing = getattr(self.colo_placement, "routing", None)
        if routing is not None:   # a MoE engine's routed experts of this step, per request
            routing.record(args[0] if args else kwargs["scheduler_output"], self.model_runner.input_batch.req_ids)
        return output

    def sample_tokens(self, *args, **kwargs):
        with self.colo_placement.pool.stream("infer").as_current():
            return super().sample_tokens(*args, **kwargs)

    def compile_or_warm_up_model(self, *args, **kwargs):
        with self.colo_placement.pool.stream("infer").as_current():
            return super().compile_or_warm_up_model(*args, **kwargs)

    def execute_dummy_batch(self, *args, **kwargs):
        with self.colo_placement.pool.stream("infer").as_current():
            return super().execute_dummy_batch(*args, **kwargs)

    def _make_model_runner(self, *args, **kwargs):
        runner = super()._make_model_runner(*args, **kwargs)
        pin_main_stream(runner, self.colo_placement.pool)
        return runner

    def _maybe_get_memory_pool_context(self, tag: str):
        if tag == "weights":
            return self.colo_placement.loading_weights(self)
        if tag == "kv_cache":
            return self.colo_placement.allocating_kv_cache()
        return super()._maybe_get_memory_pool_context(tag)


def ensure_expert_group(vllm_config) -> None:
    """vLLM makes its process-wide expert-parallel group only when the first engine of the process serves
    a MoE model; a MoE engine built after a dense one in the same process (a test run, a notebook, a
    bench comparing families) then fails in its MoE layers ("expert parallel group is not initialized").
    Make the group as vLLM's initialize_model_parallel makes it (external DP x DP x PP x PCP x TP ranks, the
    expert group across DP x PCP x TP), on every rank (it is a collective)."""
    from vllm.distributed import parallel_state

    if parallel_state._EP is not None or not vllm_config.model_config.is_moe:
        return
    parallel = vllm_config.parallel_config
    if parallel.enable_elastic_ep or parallel.enable_eplb:
        raise NotImplementedError("a MoE engine with elastic expert parallelism or EPLB after a dense engine in "
                                  "the same process: build it in a process of its own")
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    pcp, dp = parallel.prefill_context_parallel_size, parallel.data_parallel_size
    all_ranks = torch.arange(torch.distributed.get_world_size()).reshape(-1, dp, pp, pcp, tp)
    ranks = [r.tolist() for r in all_ranks.transpose(1, 2).reshape(-1, dp * pcp * tp).unbind(0)]
    world = parallel_state.get_world_group()
    parallel_state._EP = parallel_state.init_model_parallel_group(
        ranks, world.local_rank, torch.distributed.get_backend(world.device_group), group_name="ep",
        use_all2all=parallel.use_all2all)


def pin_main_stream(runner, pool) -> None:
    """Model Runner V2 caches the stream it first sees (a functools.cached_property, main_stream) to
    order its output copy after sampling and to return to after it: make that the `infer` stream."""
    if pool.device.type != "cuda":
        return
    if isinstance(getattr(type(runner), "main_stream", None), functools.cached_property):
        runner.__dict__["main_stream"] = pool.stream("infer").torch_stream()


def __getattr__(name: str):
    # Built on first use: the base is the platform's own worker, and importing either one imports
    # that platform's dependencies.
    if name == "ColoWorker":
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.v1.worker.cpu_worker import CPUWorker as base
        else:
            from vllm.v1.worker.gpu_worker import Worker as base
        cls = type("ColoWorker", (_ColoWorkerMixin, base), {"__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
