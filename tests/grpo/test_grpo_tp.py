"""`python -m colo.grpo --tensor-parallel 2` on ranks started as torchrun starts them, on CPU (gloo):
each rank's trainer holds only its shards, views of its engine's (colo.tensor_parallel), and the run
trains like one rank with the whole model, copies 0 bytes per publish, checkpoints whole weights and
resumes exactly.

The toy model has 2 attention heads and 1 KV head, so at TP=2 vLLM gives both ranks the same KV head
and their k/v gradients are summed (the case that cannot be a plain split).
"""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from conftest import free_ports

from helpers.grpo_runs import ENV, REPO, failure_report, launch, records, run_grpo, run_grpo_ranks, torchrun_command

pytestmark = pytest.mark.slow

LR = 3e-3  # the toy run's --lr (the toy preset of GRPOConfig.learning_rate)
# Eager engines: compiled tensor-parallel engines serving the trainer's shards are tests/sharing/
# test_tensor_parallel.py's; here each rank's engine start would compile again.
COMMON = ("--save-every", "1", "--keep-checkpoints", "0", "--dtype", "fp32", "--eager")


def whole_weights(out, step: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"step-{step:06d}.pt", map_location="cpu", weights_only=True)["model"]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The yardstick: the same run on one rank with the whole model."""
    out = tmp_path_factory.mktemp("grpo-one-rank")
    run_grpo(out, "--steps", "2", *COMMON)
    return out


def assert_first_step_like_one_rank(tp_run, one) -> None:
    """Step 1 of a tensor-parallel run against the one-rank run: the same completions, the same
    gradient norm and loss up to fp32 summation order, the same whole weights up to AdamW sign flips."""
    a, b = records(one)[0], records(tp_run)[0]
    # Every rank of an engine got its prompts with the same seeds: the completions of one rank.
    assert b["tokens_generated"] == a["tokens_generated"] == 8 * 8 * 16
    assert b["reward_mean"] == a["reward_mean"]
    # The whole model's gradient: each shard's part summed over the ranks, the norms counted once.
    # fp32 sums in another order (every o_proj/down_proj product and the vocabulary softmax are split
    # in two) differ by a few ulp (2^-24) of their terms, and GRPO's per-token terms, with advantages
    # of both signs, cancel to about 1/100 of their size: a relative gap of order 1e-5, bounded by 1e-4.
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    # Whole weights in the checkpoint (HF names and shapes, gathered from the shards), as one rank's.
    # AdamW's first step moves a weight by lr times the sign of its gradient (bias-corrected moments),
    # so the runs differ only where a near-zero gradient's sign flipped: at most 2 lr, rarely.
    wa, wb = whole_weights(one, 1), whole_weights(tp_run, 1)
    assert wa.keys() == wb.keys()
    gaps = torch.cat([(wa[n] - wb[n]).abs().flatten() for n in wa])
    assert float(gaps.max()) <= 2 * LR * (1 + 1e-6)
    assert float(gaps.mean()) < 1e-3 * LR


@pytest.fixture(scope="module")
def tp_jobs(tmp_path_factory):
    """Tensor parallel 2: one engine over two ranks; and a second, smaller TP=2 job started beside it on
    this host at the same time, by torchrun itself: (the first's directory, (the second's directory, exit
    status, stderr))."""
    out, beside = tmp_path_factory.mktemp("grpo-tp2"), tmp_path_factory.mktemp("grpo-tp2-beside")
    port, beside_port = free_ports(2)
    second = subprocess.Popen(torchrun_command(beside, 2, "--steps", "1", "--tensor-parallel", "2", "--eager",
                                               "--prompts-per-step", "2", "--num-generations", "2", "--dtype", "fp32",
                                               port=beside_port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    try:
        run_grpo_ranks(out, 2, "--steps", "2", "--tensor-parallel", "2", *COMMON, port=port)
    finally:
        _, stderr = second.communicate(timeout=600)
    return out, (beside, second.returncode, stderr)


@pytest.fixture(scope="module")
def two(tp_jobs):
    return tp_jobs[0]


def test_tensor_parallel_trains_like_one_rank_with_one_copy_and_resumes_exactly(one, two, tmp_path):
    resumed = tmp_path / "resumed"
    b = records(two)
    assert [r["step"] for r in b] == [1, 2]
    assert_first_step_like_one_rank(two, one)
    # One copy: the optimizer wrote into the engine's shards; the engine serves what the trainer computes.
    assert all(r["publish_bytes_copied"] == 0 for r in b)
    assert all(r["engine_logprob_max_abs_diff"] < 1e-4 for r in b)
    # Collectives per step, one micro-batch: 2 per layer forward (o_proj, down_proj), the embedding, 3 for
    # the log-probabilities; 2 per layer backward (attention and MLP inputs), the LM head's input, and
    # the replicated KV head's 4 gradients (k/v weight and bias) per layer.
    layers = json.loads((two / "toy-model" / "config.json").read_text())["num_hidden_layers"]
    assert all(r["tp_all_reduces"] == (2 * layers + 4) + (2 * layers + 1) + 4 * layers for r in b)

    assert sorted(p.name for p in two.glob("step-000001.optimizer-*")) == [
        "step-000001.optimizer-tp0-of-2.pt", "step-000001.optimizer-tp1-of-2.pt"]
    # OUT/final: the whole model gathered from the two ranks' shards, as the checkpoint holds it (fp32:
    # the weights are the masters), the tied head saved once.
    from safetensors.torch import load_file

    final, whole = load_file(two / "final" / "model.safetensors"), whole_weights(two, 2)
    assert set(final) == set(whole) - {"lm_head.weight"}
    assert all(torch.equal(final[n], whole[n]) for n in final)

    # The run as it stood after step 1 continues to step 2 exactly as the uninterrupted one did.
    resumed.mkdir()
    shutil.copytree(two / "toy-model", resumed / "toy-model")
    for path in [two / "run.json", *two.glob("step-000001*")]:
        shutil.copy(path, resumed / path.name)
    (resumed / "log.jsonl").write_text((two / "log.jsonl").read_text().splitlines()[0] + "\n")
    json_run = json.loads((two / "run.json").read_text())
    json_run["model_dir"] = str(resumed / "toy-model")
    (resumed / "run.json").write_text(json.dumps(json_run))
    run_grpo_ranks(resumed, 2, "--steps", "2", "--resume", "--eager")
    assert records(resumed)[1]["reward_mean"] == b[1]["reward_mean"]
    wr, wb2 = whole_weights(resumed, 2), whole_weights(two, 2)
    assert all(torch.equal(wr[n], wb2[n]) for n in wb2)

    # Another tensor-parallel size cannot take this optimizer state: refused before any engine starts.
    done = launch(resumed, "--steps", "3", "--resume", "--tensor-parallel", "1", "--eager", timeout=120)
    assert done.returncode == 2
    assert "--tensor-parallel 2" in done.stderr and "--tensor-parallel 1" in done.stderr


def test_two_engines_of_two_ranks_with_zero_train_like_one_rank(one, two, tmp_path):
    """Data parallel 2 x tensor parallel 2 (ranks 0-1 one engine, 2-3 another) with ZeRO-1 over the
    data-parallel ranks: each engine takes half the prompts, the ranks holding the same shards
    reduce-scatter their gradients and each steps half of them, the updated halves are all-gathered
    into the engines' shards, and the step is one rank's."""
    out = tmp_path / "dp2-tp2"
    run_grpo_ranks(out, 4, "--steps", "1", "--tensor-parallel", "2", "--shard-optimizer", *COMMON)
    assert_first_step_like_one_rank(out, one)
    first = records(out)[0]
    assert first["publish_bytes_copied"] == 0  # the all-gather landed in the engines' shards
    # AdamW's moments of a tensor-parallel rank's shards (8 bytes per fp32 element), half on each.
    unsharded = records(two)[0]["optimizer_state_bytes"]
    assert unsharded / 2 <= first["optimizer_state_bytes"] < unsharded / 2 * 1.05
    assert sorted(p.name for p in out.glob("step-000001.optimizer-*")) == [
        f"step-000001.optimizer-tp{t}-rank{d}-of-2.pt" for t in (0, 1) for d in (0, 1)]


def test_what_tensor_parallelism_cannot_take_is_refused_before_any_engine(tmp_path):
    from transformers import LlamaConfig, Qwen2Config

    import colo
    from colo.grpo import GRPOConfig
    from colo.grpo.rollout_engine import RolloutEngine
    from colo.lora import LoraSpec
    from colo.tensor_parallel import check_shardable

    with pytest.raises(NotImplementedError, match="beta"):
        GRPOConfig(tensor_parallel=2, beta=0.1)
    GRPOConfig(tensor_parallel=2, lora_rank=4)  # LoRA with TP: tests/grpo/test_lora_tp.py
    # But not vLLM's fully sharded LoRA (its slots split the adapter's rank over the ranks).
    with pytest.raises(NotImplementedError, match="fully_sharded_loras"):
        RolloutEngine(tmp_path / "no-model", colo.Pool("cpu"), seed=0, max_num_seqs=1, lora=LoraSpec(4),
                      workdir=tmp_path, tensor_parallel=2, fully_sharded_loras=True)
    toy = Qwen2Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    check_shardable(toy, 2)
    with pytest.raises(ValueError, match="2 heads"):
        check_shardable(toy, 4)  # 2 heads over 4 ranks: vLLM refuses the engine
    with pytest.raises(NotImplementedError, match="attention_bias"):
        check_shardable(LlamaConfig(hidden_size=128, num_attention_heads=2, intermediate_size=256,
                                    attention_bias=True), 2)
    # Without torchrun there is one rank: --tensor-parallel 2 is refused (exit 1) saying why.
    done = launch(tmp_path / "alone", "--steps", "1", "--tensor-parallel", "2", timeout=120)
    assert done.returncode == 1
    assert "--tensor-parallel 2 must divide the number of ranks (1)" in done.stderr
    assert "data parallel" not in done.stdout  # refused before the plan ("tensor parallel 2 x data parallel 0")


def test_two_tensor_parallel_jobs_on_one_host_at_once(tp_jobs):
    """vLLM's CPU workers name their shared-memory segments after the job (colo.vllm_compat.
    job_init_method): two TP=2 jobs started together on this host both finish (tp_jobs). Before, both
    named them after "env://" and the second failed creating its segment (errno 17)."""
    first, (second, status, stderr) = tp_jobs
    assert status == 0, failure_report(stderr)
    assert [r["step"] for r in records(first)] == [1, 2] and [r["step"] for r in records(second)] == [1]


def test_a_dead_jobs_segments_on_the_same_port_are_removed_by_the_rank_that_would_create_them(tmp_path):
    """A job that died with the same rendezvous port left its shared-memory segments, and vLLM's create
    then failed on them (errno 17). Each rank removes those it is about to create, and no other rank's."""
    from colo.vllm_compat.worker import remove_stale_segments

    names = ["colo-29500-none-tp:0-[0-1]-cpushm_0", "colo-29500-none-tp:0-[0-1]-cpushm_1",
             "colo-29500-none-tp:0-[2-3]-cpushm_0", "colo-29500-none-tp:0-[2-3]-cpushm_1",
             "colo-29501-none-tp:0-[0-1]-cpushm_0", "other-file"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    removed = remove_stale_segments("colo-29500-none", 2, directory=str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in removed] == ["colo-29500-none-tp:0-[2-3]-cpushm_0"]
    remove_stale_segments("colo-29500-none", 1, directory=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {*names} - {"colo-29500-none-tp:0-[2-3]-cpushm_0", "colo-29500-none-tp:0-[0-1]-cpushm_1"})
