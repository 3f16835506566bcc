"""Tensor parallelism with one copy (colo.tensor_parallel): on two ranks, each rank's trainer shards
are views of its vLLM engine's tensor-parallel shards; the tensor-parallel model computes what the
whole model computes, trains like one rank, and the engine serves what the optimizer wrote."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from conftest import PROMPTS
from helpers.forked import run_python_ranks
from helpers.grpo_runs import failure_report

pytestmark = pytest.mark.slow

TP_CONFIG = dict(vocab_size=777, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
ONE_KV_HEAD = dict(vocab_size=777, num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # replicated at TP=2
LR = 0.5

SCRIPT = """
import json, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
import colo
from colo.engine import build_llm, weights_region
from colo.tensor_parallel import shared_tp_model
from vllm import SamplingParams


def run(path, tp_size, dtype, out, eager):
    prompt = PROMPT
    llm = build_llm(path, colo.Pool("cpu"), dtype=dtype, kv_cache_bytes=16 << 20, max_model_len=256,
                    skip_tokenizer_init=True, tensor_parallel_size=tp_size, seed=0, enforce_eager=eager)
    tp = shared_tp_model(llm)


    def served():
        done = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        return torch.tensor([e[t].logprob for t, e in zip(prompt[1:], done[0].prompt_logprobs[1:])], dtype=torch.float64)


    params = tp.parameters()
    names = {id(p): n for n, p in tp.hf_model.named_parameters()}
    ptrs = [p.data_ptr() for p in params]
    region = weights_region(llm)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        before = tp.token_logprobs(ids)[0].double()
    served_before = served()
    tp.collectives.forward = tp.collectives.backward = 0  # count one training step's
    if dtype == "float32":
        optimizer = torch.optim.SGD(params, lr=LR)
        logp = tp.token_logprobs(ids)
        loss = -logp.mean()
        # In two backward passes, as micro-batches accumulate: each pass's gradients summed over the ranks
        # that share a KV head, never the .grad accumulated so far.
        half = logp.shape[1] // 2
        (-logp[:, :half].sum() / logp.numel()).backward(retain_graph=True)
        (-logp[:, half:].sum() / logp.numel()).backward()
        norm = tp.grad_norm(params, [p.grad for p in params])
        optimizer.step()
        values = params
    else:
        optimizer = colo.MasterWeightOptimizer(params, torch.optim.SGD, lr=LR)
        loss = -tp.token_logprobs(ids).mean()
        loss.backward()
        norm = tp.clip_grad_norm_(optimizer, None)
        optimizer.step()
        values = optimizer.masters
    counted = (tp.collectives.forward, tp.collectives.backward)
    poisoned = None
    if dtype != "float32":  # an inf in one rank's gradient: the norm is inf on both, and both skip step()
        kept = [p.detach().clone() for p in params]
        optimizer.zero_grad()
        (-tp.token_logprobs(ids).mean()).backward()
        if dist.get_rank() == 1:
            optimizer.main_grads[0].view(-1)[0] = float("inf")
        infinite = tp.clip_grad_norm_(optimizer, 1.0) == float("inf")
        optimizer.step()
        poisoned = [infinite, optimizer.skipped_steps, all(torch.equal(p, k) for p, k in zip(params, kept))]
    report = tp.publish()
    with torch.no_grad():
        after = tp.token_logprobs(ids)[0].double()
    served_after = served()
    whole = tp.full_state_dict(None if values is params else dict(zip(params, values)))
    if dist.get_rank() == 0:
        torch.save(whole, f"{out}/whole.pt")
    # The whole initial weights, as on disk, written back into the shards: the model is the untrained one again
    # (read by transformers, which turns a MoE checkpoint's per-expert tensors into its fused experts).
    from transformers import AutoModelForCausalLM
    on_disk = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    refused = []
    for bad in ({k: v for k, v in on_disk.items() if "norm" not in k}, {**on_disk, "model.norm.weight": torch.ones(3)}):
        try:
            tp.load_full_state_dict(bad)
        except ValueError as e:
            refused.append(str(e))
    tp.load_full_state_dict(on_disk)
    tp.publish()
    with torch.no_grad():
        reloaded = tp.token_logprobs(ids)[0].double()
    served_reloaded = served()
    pieces = {name: (placed.dim, placed.ranges[tp.rank]) if placed.ranges else None for name, placed in tp.layout.items()}
    torch.save({"shards": {names[id(p)]: (pieces[names[id(p)]], v.detach().float().clone()) for p, v in zip(params, values)}},
               f"{out}/rank{dist.get_rank()}.pt")
    open(f"{out}/rank{dist.get_rank()}.json", "w").write(json.dumps({
        "rank": dist.get_rank(), "tp": tp.size, "loss": loss.item(), "norm": norm, "collectives": counted,
        "layers": len(tp.hf_model.model.layers), "bytes_copied": report["bytes_copied"],
        "report_kind": type(report).__name__, "aliased_bytes": report["aliased_bytes"],
        "views": all(region.contains(p) for p in params), "ptrs_kept": [p.data_ptr() for p in params] == ptrs,
        "param_bytes": sum(p.nbytes for p in params),
        "engine_err_before": (served_before - before).abs().max().item(),
        "engine_err_after": (served_after - after).abs().max().item(),
        "changed": (after - before).abs().max().item(), "after": after.tolist(),
        "refused": refused, "poisoned": poisoned,
        "reload_err": (reloaded - before).abs().max().item(), "served_reload_err": (served_reloaded - before).abs().max().item()}))


# One engine after another in this process (each rank's world is the same for all of them).
for job in json.loads(sys.argv[1]):
    run(*job)
# Both ranks done before either tears down its engine (as colo.grpo leaves the world on the way out).
dist.barrier()
dist.destroy_process_group()
"""


def run_ranks(tmp_path, jobs, tp: int) -> list["Ran"]:
    """`tp` ranks (started as torchrun starts them) running each job (model_dir, dtype, eager) in turn, in
    the same processes (they pay vLLM's start-up once); each job's (per-rank results, per-rank shards)."""
    outs = [tmp_path / f"tp{tp}-{dtype}-{i}" for i, (_, dtype, _) in enumerate(jobs)]
    for out in outs:
        out.mkdir()
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("PROMPT", repr(list(PROMPTS[0]))).replace("LR", repr(LR)))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    argv = json.dumps([[str(model_dir), tp, dtype, str(out), eager] for (model_dir, dtype, eager), out in zip(jobs, outs)])
    run = run_python_ranks(script, [argv], env, ranks=tp, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + failure_report(run.stderr)
    return [Ran([json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)],
                [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(tp)], out) for out in outs]


class Ran(NamedTuple):
    """One job of run_ranks: each rank's results and shards, and its directory (whole.pt: the gathered weights)."""
    results: list[dict]
    shards: list[dict]
    out: Path


JOBS_OF_TEST = {"test_two_ranks_train_like_one_with_their_shards_views_of_the_engines": ("kv2", "kv1"),
                "test_a_moe_model_trains_on_two_ranks_like_on_one": ("moe",),
                "test_bf16_shards_train_with_fp32_masters_and_the_engine_serves_them": ("bf16",)}


@pytest.fixture(scope="module")
def jobs(tiny_model_dir, request):
    """The models and dtypes of the tests below that this session runs: {name: (model_dir, dtype, eager)}
    (the AVX2-persona pass, `-m cpu_kind`, runs only the bf16 test, so only its job)."""
    selected = {item.originalname for item in request.session.items if item.path == request.path}
    wanted = {job for test in selected for job in JOBS_OF_TEST.get(test, ())}
    every = {"kv2": (tiny_model_dir("qwen2", **TP_CONFIG), "float32", False),
             "kv1": (tiny_model_dir("qwen2", **ONE_KV_HEAD), "float32", False),
             "moe": (tiny_model_dir("qwen3_moe", **TP_CONFIG), "float32", True),  # compiled engines: the dense tests
             "bf16": (tiny_model_dir("qwen2", **TP_CONFIG), "bfloat16", False)}
    return {name: job for name, job in every.items() if name in wanted}


@pytest.fixture(scope="module")
def two_ranks(jobs, tmp_path_factory) -> dict[str, Ran]:
    """Every job on two tensor-parallel ranks, one launch."""
    return dict(zip(jobs, run_ranks(tmp_path_factory.mktemp("tp2"), list(jobs.values()), 2)))


@pytest.fixture(scope="module")
def one_rank(jobs, tmp_path_factory) -> dict[str, Ran]:
    """The yardsticks: the fp32 jobs on one rank with the whole model, one process."""
    fp32 = {name: job for name, job in jobs.items() if job[1] == "float32"}
    return dict(zip(fp32, run_ranks(tmp_path_factory.mktemp("tp1"), list(fp32.values()), 1)))


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_two_ranks_train_like_one_with_their_shards_views_of_the_engines(kv_heads, two_ranks, one_rank, jobs):
    """fp32, so that TP=2 and TP=1 differ only in the order of sums: the loss, the gradient norm and
    every updated shard equal the matching slice of the one-rank run's (SGD: a weight's error is lr
    times its gradient's). With one KV head, both ranks hold it and sum its gradients."""
    job = f"kv{kv_heads}"
    tp_model_dir = jobs[job][0]
    (two, two_shards, two_out), (one, (one_shards,), one_out) = two_ranks[job], one_rank[job]
    for r in two:
        assert r["tp"] == 2 and r["views"] and r["ptrs_kept"] and r["bytes_copied"] == 0
        assert r["report_kind"] == "PublishReport" and r["aliased_bytes"] == r["param_bytes"]  # colo.shared
        # vLLM serves what the trainer computes, before and after the step, through the same tensors.
        assert r["engine_err_before"] < 1e-4 and r["engine_err_after"] < 1e-4 and r["changed"] > 1e-3
        assert r["loss"] == pytest.approx(one[0]["loss"], rel=1e-5)
        assert r["norm"] == pytest.approx(one[0]["norm"], rel=1e-5)
        torch.testing.assert_close(torch.tensor(r["after"]), torch.tensor(one[0]["after"]), atol=1e-4, rtol=0)
        # Per layer 2 all-reduces forward and 2 backward; the embedding 1 forward; the log-probabilities
        # 3 (max, sum of exponentials, the target's logit); the LM head's input 1 backward; a replicated
        # KV head's k/v weights and biases 4 per layer backward; two backward passes.
        layers = r["layers"]
        assert r["collectives"] == [2 * layers + 1 + 3, 2 * (2 * layers + 1 + (4 * layers if kv_heads == 1 else 0))]
    # Each rank holds about half the weights: everything but the norms (and a lone KV head) is split.
    # colo.plan's colo-TP layout counts P_T; the vocabulary splits 416 / 361 rows here, hence 4%.
    from colo.plan import plan, shape_from_config

    colo_tp, _ = plan(one[0]["param_bytes"] // 4, 2, 1 << 30, dtype="fp32", tensor_parallel=2,
                      shape=shape_from_config(str(tp_model_dir / "config.json")))
    planned = next(t.bytes for t in colo_tp.terms if t.what.startswith("weights"))
    for r in two:
        assert r["param_bytes"] == pytest.approx(planned, rel=0.04)
    # Together the ranks hold the model once, plus what both hold whole once more: the norms, and
    # with one KV head its k/v projections (weights and biases).
    shape = shape_from_config(str(tp_model_dir / "config.json"))
    both_hold = shape.replicated_params + (shape.kv_projection_params + 2 * shape.layers * shape.head_dim
                                           if kv_heads == 1 else 0)
    assert sum(r["param_bytes"] for r in two) == one[0]["param_bytes"] + 4 * both_hold
    # Whole weights gathered on rank 0 (what a checkpoint keeps) are the one-rank run's, name for name,
    # and the whole weights on disk written back into each rank's shards give the untrained model.
    from safetensors.torch import load_file

    gathered, single = (torch.load(out / "whole.pt", weights_only=True) for out in (two_out, one_out))
    on_disk = set(load_file(tp_model_dir / "model.safetensors"))
    # The names state_dict() gives: a tied head's too (save_pretrained leaves it out; it is the embedding).
    assert set(gathered) == set(single) and on_disk <= set(gathered) and set(gathered) - on_disk <= {"lm_head.weight"}
    for name, value in gathered.items():
        torch.testing.assert_close(value, single[name], atol=LR * 1e-5, rtol=1e-5, msg=name)
    assert all(r["reload_err"] < 1e-9 and r["served_reload_err"] < 1e-4 for r in two)
    whole = one_shards["shards"]
    for rank, saved in enumerate(two_shards):
        for name, (shard, value) in saved["shards"].items():
            expected = whole[name][1]
            torch.testing.assert_close(value, rank_part(expected, shard), atol=LR * 1e-5, rtol=1e-5,
                                       msg=f"rank {rank}: {name}")


def rank_part(whole, shard):
    """A rank's part of a whole tensor: its (start, stop) segments along dim, one after another."""
    if shard is None:
        return whole
    dim, segments = shard
    return torch.cat([whole.narrow(dim, start, stop - start) for start, stop in segments], dim)


def test_a_moe_model_trains_on_two_ranks_like_on_one(two_ranks, one_rank):
    """Qwen3-MoE at TP=2: every expert's width split over the ranks (each rank's `gate_up_proj` its gate
    rows then its up rows, a view of its engine's `w13_weight`), the router whole and its gradient summed:
    the loss, the gradient norm, the served log-probabilities and every updated shard equal the one-rank
    run's."""
    (two, two_shards, two_out), (one, (one_shards,), one_out) = two_ranks["moe"], one_rank["moe"]
    for r in two:
        assert r["views"] and r["ptrs_kept"] and r["bytes_copied"] == 0 and r["aliased_bytes"] == r["param_bytes"]
        assert r["engine_err_before"] < 1e-4 and r["engine_err_after"] < 1e-4 and r["changed"] > 1e-3
        assert r["loss"] == pytest.approx(one[0]["loss"], rel=1e-5)
        assert r["norm"] == pytest.approx(one[0]["norm"], rel=1e-5)
        # After the step the two runs' weights differ by rounding (checked below, shard by shard); a token
        # whose router was near a tie may then pick another expert, so the log-probabilities agree less
        # closely than a dense model's.
        torch.testing.assert_close(torch.tensor(r["after"]), torch.tensor(one[0]["after"]), atol=1e-2, rtol=0)
    gathered, single = (torch.load(out / "whole.pt", weights_only=True) for out in (two_out, one_out))
    assert set(gathered) == set(single)
    for name, value in gathered.items():
        torch.testing.assert_close(value, single[name], atol=LR * 1e-5, rtol=1e-5, msg=name)
    whole = one_shards["shards"]
    experts = 0
    for rank, saved in enumerate(two_shards):
        for name, (shard, value) in saved["shards"].items():
            experts += name.endswith("experts.gate_up_proj") and len(shard[1]) == 2  # gate rows, then up rows
            torch.testing.assert_close(value, rank_part(whole[name][1], shard), atol=LR * 1e-5, rtol=1e-5,
                                       msg=f"rank {rank}: {name}")
    assert experts == 2 * 2  # two layers, two ranks


@pytest.mark.cpu_kind
def test_bf16_shards_train_with_fp32_masters_and_the_engine_serves_them(two_ranks):
    """bf16 shards step through fp32 masters and the engine serves what they wrote; a gradient that is not
    finite on one rank (tp.clip_grad_norm_, as docs/tensor-parallel.md's loop) skips the step on every rank."""
    two = two_ranks["bf16"].results
    for r in two:
        assert r["views"] and r["ptrs_kept"] and r["bytes_copied"] == 0 and r["changed"] > 1e-2
        # bf16: vLLM's GEMMs and the trainer's round in other orders (as test_weights' bf16 bound).
        assert r["engine_err_before"] < 5e-2 and r["engine_err_after"] < 5e-2
        assert r["reload_err"] < 1e-9 and r["served_reload_err"] < 5e-2  # the disk's weights, rounded as at load
        # Whole weights that miss a tensor or have another shape are refused, naming it, before any is written.
        assert len(r["refused"]) == 2 and "norm.weight" in r["refused"][0] and "(3,)" in r["refused"][1]
        # tp.clip_grad_norm_ with an inf on rank 1 only: every rank's norm inf, its step skipped, its shards kept.
        assert r["poisoned"] == [True, 1, True]
    assert two[0]["loss"] == two[1]["loss"] and two[0]["norm"] == pytest.approx(two[1]["norm"], rel=1e-6)


def test_each_ranks_config_has_its_shapes_and_sizes_vllm_refuses_are_refused():
    from transformers import Qwen2Config

    from colo.tensor_parallel import local_config

    one_kv = local_config(Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=1, vocab_size=777), 2, 416)
    assert (one_kv.num_attention_heads, one_kv.num_key_value_heads) == (2, 1)  # the KV head replicated
    with pytest.raises(ValueError, match="2 KV heads neither split over nor divide 3"):
        local_config(Qwen2Config(hidden_size=96, intermediate_size=96, num_attention_heads=6,
                                 num_key_value_heads=2, vocab_size=777), 3, 259)
    local = local_config(Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=777, pad_token_id=700), 2, 416)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.head_dim,
            local.vocab_size, local.pad_token_id) == (2, 1, 128, 32, 416, None)
    with pytest.raises(ValueError, match="must split over 3 ranks"):
        local_config(Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=3, vocab_size=777), 3, 259)
