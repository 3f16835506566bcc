"""`python -m colo.gpu_check`: everything of colo that can run on a GPU machine without vLLM, in a few
minutes, written to one JSON report. For whoever is lent a GPU (docs/gpu.md says how to set it up).

    python -m colo.gpu_check [--json gpu-check.json] [--device cuda|cpu]

Each check is small, real work on the device, and says what it saw:

  pool_sleep_wake      a region filled, slept with offload and woken: same address, same bytes; slept
                       without offload: memory returned, same address (driver VMM on a GPU)
  mempool_routing      torch's own allocations inside pool.use(name) land in that region (GPU only:
                       torch's CPU allocator cannot be routed)
  streams_and_events   the pool's 'train' stream has a lower priority than 'infer' and 'copy'; work on
                       one stream ordered after another's through a colo event, and a batched copy;
                       Stream.as_current (what the engine's steps run under) makes 'infer' current
  overlap_handover     a small Hugging Face model's groups trained on the pool's 'train' stream, on the
                       overlap's trainer thread, while the step's stream works: the same gradients as
                       the groups trained one after another
  zero1_math           ZeRO-1's optimizer against the unsharded master-weight optimizer, a few steps
  chunked_logprobs     chunked log-probabilities against all logits at once, values and gradients, fp32
                       and bf16, the head's gradient summed in fp32 (into the optimizer's main_grad)
  moe_router_replay    a tiny bf16 Qwen3-MoE's routers forced to other experts (routing replay): the
                       experts get those, the routers still a gradient

--device cpu runs the same checks on the host pool, which is how the command is tested without a GPU.
Exit status 0 when every check that applies passed, 1 otherwise; the report holds each check's
status (passed, failed or skipped, with why), seconds and details, the device and the versions.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

MiB = 1 << 20


class Skip(Exception):
    """A check that does not apply on this device."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pool_sleep_wake(device: torch.device) -> dict:
    import colo

    pool = colo.Pool(device)
    region = pool.region("kv_cache", budget=256 * MiB)
    tensor = region.empty((64, MiB // 4), dtype=torch.float32)
    tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32, device=device).view_as(tensor))
    expected, address = tensor.clone(), tensor.data_ptr()
    _sync(device)
    region.sleep(offload=True)
    asleep = region.stats()
    region.wake()
    _sync(device)
    if tensor.data_ptr() != address or not torch.equal(tensor, expected):
        raise AssertionError("after sleep(offload=True) and wake() the region's tensor moved or changed")
    offload_s = asleep["last_sleep_seconds"] + region.stats()["last_wake_seconds"]
    region.sleep(offload=False)
    released = region.stats()["resident_bytes"]
    region.wake()
    tensor.fill_(1.0)
    _sync(device)
    if tensor.data_ptr() != address or released != 0:
        raise AssertionError(f"sleep(offload=False) kept {released} bytes resident or moved the tensor")
    return {"backend": pool.backend, "granularity_bytes": pool.granularity, "bytes": tensor.numel() * 4,
            "resident_bytes_asleep": asleep["resident_bytes"], "offload_sleep_wake_s": offload_s}


def mempool_routing(device: torch.device) -> dict:
    import colo

    if device.type != "cuda":
        raise Skip("torch's CPU allocator cannot be routed into a region (pool.use runs the block unchanged)")
    pool = colo.Pool(device)
    region = pool.region("grads", budget=256 * MiB)
    before = region.stats()["allocated_bytes"]
    with pool.use("grads"):
        routed = torch.empty((64, MiB), dtype=torch.uint8, device=device)
    outside = torch.empty((MiB,), dtype=torch.uint8, device=device)
    grew = region.stats()["allocated_bytes"] - before
    if grew < routed.numel():
        raise AssertionError(f"64 MiB allocated inside pool.use('grads'), the region grew by {grew} bytes")
    region_after = region.stats()["allocated_bytes"]
    del outside
    return {"routed_bytes": routed.numel(), "region_allocated_bytes": region_after}


def streams_and_events(device: torch.device) -> dict:
    import colo

    pool = colo.Pool(device)
    details = {}
    if device.type == "cuda":
        streams = {role: pool.stream(role).torch_stream() for role in ("train", "infer", "copy")}
        priority = {role: s.priority for role, s in streams.items()}  # lower number: higher priority
        details["priorities"] = priority
        if not (priority["train"] > priority["infer"] and priority["train"] > priority["copy"]):
            raise AssertionError(f"the train stream is not of lower priority than the others: {priority}")
        a = torch.randn(2048, 2048, device=device)
        with torch.cuda.stream(streams["train"]):
            for _ in range(8):
                a = a @ a / a.norm()
            done = pool.stream("train").record()
        pool.stream("infer").wait(done)
        with torch.cuda.stream(streams["infer"]):
            seen = a.clone()
        _sync(device)
        if not torch.equal(seen, a):
            raise AssertionError("work on 'infer' after waiting for 'train''s event did not see its result")
        # What the engine's steps run under (colo.vllm_compat.worker): the infer stream is torch's current
        # stream in the block, after the caller's work, and the caller's stream after the block's.
        before = torch.cuda.current_stream(device)
        b = a @ a
        with pool.stream("infer").as_current():
            inside = torch.cuda.current_stream(device)
            c = b @ b
        after = torch.cuda.current_stream(device)
        d = c.clone()
        _sync(device)
        if inside != streams["infer"] or after != before or not torch.equal(d, (a @ a) @ (a @ a)):
            raise AssertionError(f"Stream.as_current: inside {inside}, after {after} (before {before})")
        details["engine_steps_on"] = {"stream": "infer", "priority": inside.priority}
        from colo.engine import GRAPH_PRIORITY_SETTING  # noqa: F401 - sets it before CUDA starts, where it can
        import os

        details[GRAPH_PRIORITY_SETTING] = os.environ.get(GRAPH_PRIORITY_SETTING)
    source = torch.randn(4 * MiB // 4, device=device)
    target = torch.empty_like(source)
    event = pool.copy_async([(target, source)])
    event.synchronize()
    if not torch.equal(target, source):
        raise AssertionError("pool.copy_async's copy differs from its source")
    details["copied_bytes"] = source.numel() * 4
    return details


def _tiny_llama(device: torch.device, dtype=torch.float32, vocab: int = 512, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def overlap_handover(device: torch.device) -> dict:
    import colo
    from colo.grpo.overlap import GroupTrainer, cpu_split

    model, reference = _tiny_llama(device), _tiny_llama(device)
    groups = [torch.randint(0, 512, (4, 48), device=device) for _ in range(4)]

    def loss_of(m, ids):
        return m(input_ids=ids).logits.float().log_softmax(-1).mean()

    for ids in groups:  # the groups one after another, on the step's stream
        loss_of(reference, ids).backward()
    stream = colo.Pool(device).stream("train").torch_stream() if device.type == "cuda" else None

    def work(index, ids):
        loss_of(model, ids).backward()
        return index

    engine, trainer = cpu_split(torch.get_num_threads())
    started = time.perf_counter()
    handover = GroupTrainer(work, device=device, engine_threads=engine, trainer_threads=trainer, stream=stream)
    busy = torch.randn(512, 512, device=device)
    for index, ids in enumerate(groups):
        handover.submit(index, ids)
        for _ in range(4):  # the step's stream keeps working meanwhile, as an engine decoding would
            busy = busy @ busy / busy.norm()
    handover.generation_done()
    outcome = handover.join()
    _sync(device)
    seconds = time.perf_counter() - started
    worst = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-30))
                for p, q in zip(model.parameters(), reference.parameters()))
    if sorted(outcome.results) != list(range(len(groups))) or worst > 1e-5:
        raise AssertionError(f"groups trained {sorted(outcome.results)}, largest relative gradient gap {worst}")
    return {"groups": len(groups), "trained_during_generation": outcome.trained_during_generation,
            "largest_relative_gradient_gap": worst, "seconds": seconds,
            "train_stream": "pool 'train'" if stream is not None else "none (CPU)"}


def zero1_math(device: torch.device) -> dict:
    from colo import MasterWeightOptimizer, ShardedMasterWeightOptimizer

    torch.manual_seed(0)
    values = [torch.randn(300, 70, device=device), torch.randn(1000, device=device)]
    sides = {}
    for name, build in (("unsharded", MasterWeightOptimizer), ("zero1", ShardedMasterWeightOptimizer)):
        params = [torch.nn.Parameter(v.to(torch.bfloat16)) for v in values]
        optimizer = build(params, torch.optim.AdamW, lr=1e-2)
        for step in range(3):
            (sum((p.float() * (step + 1)).square().sum() for p in params) / 1e4).backward()
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
        sides[name] = optimizer.state_dict()["master_weights"].float().cpu()  # in parameter order on both
    gap = float((sides["unsharded"] - sides["zero1"]).abs().max())
    if gap > 1e-6:
        raise AssertionError(f"ZeRO-1's masters differ from the unsharded optimizer's by {gap}")
    return {"steps": 3, "largest_master_gap": gap}


def chunked_logprobs(device: torch.device) -> dict:
    from colo import MasterWeightOptimizer
    from colo.grpo.logprobs import completion_logprobs_chunked, full_logits_logprobs

    details = {}
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        name = str(dtype).removeprefix("torch.")
        models = [_tiny_llama(device, dtype) for _ in range(2)]
        torch.manual_seed(1)
        ids = torch.randint(0, 512, (3, 80), device=device)
        completion = ids[:, 40:]
        position_ids = torch.arange(80, device=device).expand(3, -1)
        mask = torch.ones_like(ids)
        optimizer = MasterWeightOptimizer(models[0].parameters(), torch.optim.AdamW) if dtype != torch.float32 \
            else None  # the bf16 side as colo.grpo trains it: the head's gradient summed into main_grad
        chunked = completion_logprobs_chunked(models[0], ids, mask, position_ids, completion, chunk_tokens=16)
        full = full_logits_logprobs(models[1], ids, mask, position_ids, completion)
        value_gap = float((chunked - full).detach().abs().max())
        chunked.sum().backward()
        full.sum().backward()
        head_chunked = (optimizer.main_grads[-1] if optimizer is not None else models[0].lm_head.weight.grad).float()
        head_full = models[1].lm_head.weight.grad.float()
        head_gap = float((head_chunked - head_full).abs().max() / head_full.abs().max())
        if value_gap > tolerance or head_gap > tolerance or not math.isfinite(head_gap):
            raise AssertionError(f"{name}: chunked log-probabilities differ by {value_gap}, the head's gradient by "
                                 f"{head_gap} (relative), tolerance {tolerance}")
        details[name] = {"logprob_gap": value_gap, "head_gradient_relative_gap": head_gap}
    return details


def moe_router_replay(device: torch.device) -> dict:
    """A tiny Qwen3-MoE in bf16 on the device, its routers forced to other experts than their own
    (colo.moe_routing, what --routing-replay does in training): the experts modules get exactly those,
    with the routers' softmax gates over them, and the routers still get a gradient."""
    import transformers

    from colo.bench.models import random_model
    from colo.moe_routing import RouterReplay

    if int(transformers.__version__.split(".")[0]) < 5:
        raise Skip(f"transformers {transformers.__version__}: routing replay follows transformers 5's MoE layers")
    model = random_model(dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=64), arch="qwen3_moe",
                         dtype=torch.bfloat16).to(device)
    replay = RouterReplay.attach(model)
    used = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_hook(lambda m, args, out, name=name: used.__setitem__(name, args[1]))
    ids = torch.randint(0, 512, (2, 24), device=device)
    with torch.no_grad():
        model(input_ids=ids)
    own = [used[name].clone() for name in sorted(used)]
    forced = torch.stack([(indices + 1) % 4 for indices in own], dim=1).view(2, 24, len(own), -1)
    with replay.forcing(forced.to(torch.int16)):
        model(input_ids=ids, labels=ids).loss.backward()
    for column, name in enumerate(sorted(used)):
        if not torch.equal(used[name], forced[:, :, column].reshape(-1, forced.shape[-1]).long()):
            raise AssertionError(f"{name}: the experts module was not given the forced experts")
    grads = [layer.mlp.gate.weight.grad for layer in model.model.layers]
    if any(g is None or not torch.isfinite(g).all() or g.abs().sum() == 0 for g in grads):
        raise AssertionError("a router got no finite, non-zero gradient through the forced experts")
    return {"forced_pairs": replay.forced, "router_mismatch": replay.stats()["router_mismatch"],
            "rules": sorted(set(replay._rules.values()))}


def share_check_rounding(device: torch.device) -> dict:
    """colo.share_check's statistic on the device's own kernels, without vLLM: a bf16 Llama whose head is
    scaled to a real model's logits (log-probabilities over tens of nats) computed by two implementations
    of the same function, transformers' SDPA attention standing for the engine and its eager attention for
    the trainer, is within the check's bound of the fp32 computation; and the same model with another
    rms_norm_eps on the trainer's side is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from colo.share_check import gap_to, probe_ids, trainer_logprobs

    def llama(attention: str, eps: float = 1e-6):
        config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                             tie_word_embeddings=False, rms_norm_eps=eps, attn_implementation=attention)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(60)
        return model.to(device=device, dtype=torch.bfloat16).eval()

    generator = torch.Generator().manual_seed(1)
    sequences = [probe_ids(4096, 64), torch.randint(0, 4096, (64,), generator=generator).tolist()]
    engine = trainer_logprobs(llama("sdpa"), sequences)
    same = gap_to(engine, torch.bfloat16, llama("eager"), sequences)
    other = gap_to(engine, torch.bfloat16, llama("eager", eps=1e-2), sequences)
    if not same.within:
        raise AssertionError(f"two implementations of the same function refused: {same.describe()}")
    if other.within:
        raise AssertionError(f"another rms_norm_eps passed: {other.describe()}")
    return {"same_function": {"engine": same.engine, "rounding": same.rounding, "tolerance": same.tolerance},
            "other_eps": {"engine": other.engine, "rounding": other.rounding, "tolerance": other.tolerance}}


CHECKS = (pool_sleep_wake, mempool_routing, streams_and_events, overlap_handover, zero1_math, chunked_logprobs,
          moe_router_replay, share_check_rounding)


def run_checks(device: torch.device, checks=CHECKS) -> list[dict]:
    results = []
    for check in checks:
        started = time.perf_counter()
        try:
            details, status, why = check(device), "passed", ""
        except Skip as e:
            details, status, why = {}, "skipped", str(e)
        except Exception as e:  # noqa: BLE001 - every failure is reported, the other checks still run
            last = traceback.extract_tb(e.__traceback__)[-1]
            details, status = {}, "failed"
            why = f"{type(e).__name__}: {e} ({Path(last.filename).name}:{last.lineno})"
        results.append({"check": check.__name__, "status": status, "seconds": round(time.perf_counter() - started, 3),
                        **({"why": why} if why else {}), "details": details})
    return results


def environment(device: torch.device) -> dict:
    import colo

    env = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "colo_build": colo.build_info()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colo.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="gpu-check.json", metavar="PATH", help="the report (default %(default)s)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default), or cpu: the same checks on the host pool")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("colo.gpu_check: torch sees no GPU here (torch.cuda.is_available() is False); --device cpu runs the "
              "same checks on the host pool", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    started = time.perf_counter()
    results = run_checks(device)
    report = {"environment": environment(device), "checks": results,
              "passed": sum(r["status"] == "passed" for r in results),
              "failed": sum(r["status"] == "failed" for r in results),
              "skipped": sum(r["status"] == "skipped" for r in results),
              "seconds": round(time.perf_counter() - started, 1)}
    Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    for r in results:
        print(f"{r['check']:<20} {r['status']:<8} {r['seconds']:>7.2f} s  {r.get('why', '')}")
    print(f"colo.gpu_check: {report['passed']} passed, {report['failed']} failed, {report['skipped']} skipped in "
          f"{report['seconds']} s; report in {args.json}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
