"""python -m colo.plan: the arithmetic of each layout, the command line, bad input. (The comparison
with what the pool measures is in tests/bench/test_bench.py, memory section.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from colo.plan import SHAPES, parse_bytes, plan

P = 7e9
GiB = 1 << 30


def layouts(**kwargs):
    return {layout.name.split(" ")[0]: layout for layout in plan(P, 8, 80 * GiB, **kwargs)}


def sampler_bytes(layout) -> int:
    return next(t.bytes for t in layout.terms if t.what.startswith("engine sampler buffers"))


def test_every_engine_holds_vllm_v2s_sampler_buffers_from_its_start():
    """vLLM 0.32's Model Runner V2 (a GPU's default) allocates max_num_seqs x vocab int32 bin counts,
    two bit masks and per-sequence tables in load_model: every layout holds them, in both phases."""
    vocab = SHAPES["Qwen2.5-7B"]["vocab"]
    for layout in layouts().values():  # vLLM's default for an 80 GiB GPU: 1024 sequences
        term = next(t for t in layout.terms if t.what.startswith("engine sampler buffers"))
        assert term.bytes == 4 * 1024 * vocab + 8 * 1024 * -(-vocab // 32) + 4481 * 4 * 1024
        assert term.generate and term.train and not term.host
    assert sampler_bytes(layouts(max_num_seqs=512)["colo"]) == 339_789_824 if vocab == 151936 else True
    assert not any(t.what.startswith("engine sampler") for t in layouts(max_num_seqs=0)["colo"].terms)


def test_bytes_per_gpu_by_phase_follow_each_layouts_rule():
    by = layouts(seq_len=4096)
    colo, trl, verl = by["colo"], by["TRL"], by["verl"]
    act = next(t.bytes for t in colo.terms if t.what.startswith("activations"))
    s = sampler_bytes(colo)
    assert colo.phase_bytes("generate") == 2 * P + s  # one bf16 copy; gradients asleep, optimizer on the host
    assert colo.phase_bytes("train") == 18 * P + act + s and colo.host_bytes == 12 * P
    assert trl.phase_bytes("generate") == 18 * P + s and trl.phase_bytes("train") == 18 * P + act + s
    assert verl.phase_bytes("generate") == 16 * P // 8 + 2 * P + s
    assert by["colo"].kv_during_train is False and trl.kv_during_train is True
    # 7B on 80 GB: a replicated fp32 optimizer does not fit, colo's or TRL's; FSDP's shards do.
    assert not colo.fits and not trl.fits and verl.fits and verl.sequences > 0
    fp32 = layouts(dtype="fp32")["colo"]
    assert fp32.phase_bytes("generate") == 4 * P + s and fp32.host_bytes == 8 * P
    # ZeRO-1: one bf16 copy, whole fp32 gradients, 1/8 of the optimizer state; it fits, with more
    # room for the KV cache than FSDP beside an engine copy.
    zero = by["colo-ZeRO-1"]
    assert zero.phase_bytes("generate") == 2 * P + s and zero.host_bytes == 12 * P // 8
    assert zero.phase_bytes("train") == 2 * P + 4 * P + 12 * P // 8 + act + s
    assert zero.fits and zero.sequences > verl.sequences


def test_kv_cache_gets_what_the_phases_leave():
    small = {layout.name.split(" ")[0]: layout for layout in plan(0.5e9, 8, 80 * GiB, seq_len=2048)}
    colo, trl = small["colo"], small["TRL"]
    usable = 80 * GiB - colo.reserve
    assert colo.kv_cache_bytes == usable - colo.phase_bytes("generate")
    assert trl.kv_cache_bytes == usable - trl.phase_bytes("train")  # its KV cache stays while training
    assert colo.sequences == colo.kv_cache_bytes // colo.kv_bytes_per_sequence > trl.sequences
    # Overlapped: the gradients and one micro-batch's activations are awake while generating, so the
    # KV cache gets that much less than colo's serial layout; training holds the same.
    overlapped = next(layout for layout in small.values() if "overlapped" in layout.name)
    act = next(t.bytes for t in colo.terms if t.what.startswith("activations"))
    assert overlapped.phase_bytes("generate") == colo.phase_bytes("generate") + 4 * int(0.5e9) + act
    assert overlapped.phase_bytes("train") == colo.phase_bytes("train")
    assert overlapped.kv_cache_bytes == colo.kv_cache_bytes - 4 * int(0.5e9) - act
    shape = SHAPES["Qwen2.5-0.5B"]
    assert colo.kv_bytes_per_sequence == 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2 * 2048


def test_command_line_prints_the_arithmetic_and_json():
    run = [sys.executable, "-m", "colo.plan", "--params", "7e9", "--gpus", "8", "--gpu-memory", "80GiB"]
    text = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "12 x P" in text and "16 x P / 8" in text and "Qwen2.5-7B-like" in text and "does not fit" in text
    data = json.loads(subprocess.run(run + ["--json"], capture_output=True, text=True, check=True).stdout)
    names = [layout["layout"].split(" ")[0] for layout in data["layouts"]]
    assert names == ["colo", "TRL", "verl", "colo-ZeRO-1", "colo,"]
    sampler = next(t["bytes"] for t in data["layouts"][0]["terms"] if t["what"].startswith("engine sampler"))
    assert data["layouts"][0]["generate_bytes"] == 14e9 + sampler
    several = json.loads(subprocess.run(run[:4] + ["0.5e9,7e9", "--json"], capture_output=True, text=True,
                                        check=True).stdout)
    assert [d["params"] for d in several] == [0.5e9, 7e9] and several[1]["shape"]["name"] == "Qwen2.5-7B-like"


@pytest.mark.parametrize("args,message", [
    (["--params", "7e9", "--gpu-memory", "80XB"], "cannot read '80XB' as a size"),
    (["--params", "0"], "must be positive"),
    (["--params", "7e9,big"], "expected numbers"),
    (["--params", "7e9", "--config", "/nonexistent/config.json"], "No such file"),
])
def test_bad_input_exits_with_a_message(args, message):
    done = subprocess.run([sys.executable, "-m", "colo.plan", *args], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr


def test_sizes_parse():
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("512") == 512


def test_tensor_parallel_layouts_hold_one_ranks_shard():
    """colo-TP: each rank's weights are its engine shard P_T = (P - R) / tp + R (R: the replicated norm
    weights; with as many KV heads as ranks the k/v projections split like the rest), its gradients the shard's, its optimizer state the shard over the data-parallel ranks;
    verl: FSDP's fp32 shards of the whole model beside a tensor-parallel engine copy, which sleeps to
    the host while training."""
    shape = SHAPES["Qwen2.5-32B"]
    colo, verl = plan(32.8e9, 16, 80 * GiB, tensor_parallel=8)
    replicated = (2 * shape["layers"] + 1) * shape["hidden"]
    shard = (int(32.8e9) - replicated) // 8 + replicated
    assert colo.params_per_rank == verl.params_per_rank == shard and colo.tensor_parallel == 8
    act = next(t.bytes for t in colo.terms if t.what.startswith("activations"))
    assert act == int((10 + 24 / 8) * 4096 * shape["layers"] * shape["hidden"]) + 10 * 4096 * shape["vocab"] // 8
    s = sampler_bytes(colo)  # every rank's engine has the whole vocabulary's
    assert colo.phase_bytes("generate") == 2 * shard + s
    assert colo.phase_bytes("train") == 2 * shard + 4 * shard + 12 * shard // 2 + act + s  # ZeRO-1 over 16 / 8 = 2
    assert colo.host_bytes == 12 * shard // 2
    full_act = next(t.bytes for t in verl.terms if t.what.startswith("activations"))
    assert full_act > act  # FSDP keeps every layer's whole activations
    assert verl.phase_bytes("generate") == 16 * int(32.8e9) // 16 + 2 * shard + s
    assert verl.phase_bytes("train") == 16 * int(32.8e9) // 16 + full_act + s and verl.host_bytes == 2 * shard
    # vLLM gives each rank 8 / 8 = 1 KV head: the KV cache per sequence is 1/8 of the whole model's.
    assert colo.kv_bytes_per_sequence == 2 * shape["layers"] * 1 * shape["head_dim"] * 2 * 4096
    assert colo.sequences == colo.kv_cache_bytes // colo.kv_bytes_per_sequence > 0


def test_fewer_kv_heads_than_ranks_replicate_one_head_per_rank():
    shape = SHAPES["Qwen2.5-1.5B"]  # 12 heads, 2 KV heads: at tensor parallel 4, each rank holds one KV head
    colo, _ = plan(1.5e9, 4, 80 * GiB, tensor_parallel=4, seq_len=1024)
    assert colo.kv_bytes_per_sequence == 2 * shape["layers"] * 1 * shape["head_dim"] * 2 * 1024
    # ... and its k/v projections whole: they split 2 ways, the rest 4 ways.
    replicated = (2 * shape["layers"] + 1) * shape["hidden"]
    kv = 2 * shape["layers"] * 2 * shape["head_dim"] * shape["hidden"]
    assert colo.params_per_rank == (int(1.5e9) - replicated - kv) // 4 + replicated + kv // 2


@pytest.mark.parametrize("params,gpus,tp,message", [
    (32.8e9, 8, 3, "8 GPUs do not split into tensor-parallel groups of 3"),
    (7e9, 8, 8, "28 attention heads do not split over tensor parallel 8"),
    (0.5e9, 14, 7, "2 KV heads neither split over nor divide tensor parallel 7"),
    (7e9, 8, 0, "must be positive"),
])
def test_tensor_parallel_sizes_vllm_refuses_are_refused(params, gpus, tp, message):
    with pytest.raises(ValueError, match=message):
        plan(params, gpus, 80 * GiB, tensor_parallel=tp)


def test_command_line_plans_tensor_parallel():
    run = [sys.executable, "-m", "colo.plan", "--params", "70e9", "--gpus", "8", "--tensor-parallel", "8"]
    text = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "P_T = (P - R - K) / 8 + R + K / 8" in text and "Llama-3-70B-like" in text and "12 x P_T / 1" in text
    data = json.loads(subprocess.run(run + ["--json"], capture_output=True, text=True, check=True).stdout)
    assert data["tensor_parallel"] == 8 and [layout["layout"].split(" ")[0] for layout in data["layouts"]] == ["colo-TP", "verl"]
    refused = subprocess.run(run[:-1] + ["3"], capture_output=True, text=True)
    assert refused.returncode == 2 and "do not split into tensor-parallel groups of 3" in refused.stderr


def test_image_tokens_count_as_prompt_tokens(capsys):
    """A vision-language model's image placeholders are prompt tokens to the KV cache and the activations."""
    import json

    from colo.plan import main

    main(["--params", "8e9", "--gpus", "8", "--seq-len", "1000", "--image-tokens", "256", "--json"])
    with_images = json.loads(capsys.readouterr().out)
    main(["--params", "8e9", "--gpus", "8", "--seq-len", "1256", "--json"])
    assert with_images == json.loads(capsys.readouterr().out)
    main(["--params", "8e9", "--gpus", "8", "--seq-len", "1000", "--json"])
    assert with_images != json.loads(capsys.readouterr().out)
