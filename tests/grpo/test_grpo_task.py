"""colo.grpo on a user's task, without an engine: datasets through the real model's tokenizer and chat
template (SmolLM2-135M-Instruct, colo.smollm2), reward functions in TRL's signature, the checks on
what they return, TRL's advantage and loss-type arithmetic, the built-in toy task, and the up-front
refusals of the config, the CLI and the scheduler."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colo.grpo import arithmetic, cli
from colo.grpo.config import GRPOConfig
from colo.grpo.loss import group_advantages, grpo_loss, loss_denominators
from colo.grpo.rewards import gsm8k_reward, load_reward, math_reward, regex_reward
from colo.grpo.task import DatasetTask, RewardError, Scores, check_rewards
from colo.hub import load_dataset_file
from colo.grpo.toy_task import ToyTask

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(smollm2_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_model_dir)


def chat_rows(n=5):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i), "level": i}
            for i in range(n)]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- reward functions ----------------------------------------------------------------------------
def test_builtin_rewards_score_text_and_messages():
    as_messages = [[{"role": "assistant", "content": "It is 42."}], [{"role": "assistant", "content": "41"}]]
    assert math_reward(as_messages, answer=["42", "42"]) == [1.0, 0.0]
    assert math_reward(["\\frac{1}{2}", "0.5", "no idea"], solution=["1/2"] * 3) == [1.0, 1.0, 0.0]
    assert math_reward(["7"], answer=["not math at all"]) == [None]  # gold unparseable: skipped, as TRL
    assert gsm8k_reward(["so #### 1,234", "the answer is 12 then 18"], answer=["x #### 1234", "#### 18"]) == [1.0, 1.0]
    assert gsm8k_reward(["#### 17"], answer=["#### 18"]) == [0.0]
    assert regex_reward(r"^\d+$")(["12", "twelve"]) == [1.0, 0.0]


def test_load_reward_names_what_is_wrong(tmp_path):
    good = tmp_path / "my_rewards.py"
    good.write_text("LIMIT = 3\ndef short(completions, **kw):\n    return [float(len(c) < LIMIT) for c in completions]\n")
    assert load_reward(f"{good}:short")(["ab", "abcd"]) == [1.0, 0.0]
    assert load_reward("colo.grpo.rewards:gsm8k_reward") is gsm8k_reward
    for spec, message in [(f"{tmp_path}/missing.py:f", "no file"), (f"{good}:long", "has no 'long'"),
                          (f"{good}:LIMIT", "not a function"), ("no_such_module_xyz:f", "cannot import"),
                          ("mathh", "expected FILE.py:NAME"), ("regex:(", "not a regular expression")]:
        with pytest.raises(ValueError, match=message):
            load_reward(spec)


def test_reward_outputs_are_checked():
    assert check_rewards([1, None, 0.5], 3, "f", 1)[1] != check_rewards([1, None, 0.5], 3, "f", 1)[1]  # NaN
    for values, message in [([1.0], "returned 1 rewards for 3"), ([1.0, math.nan, 0.0], "must be finite"),
                            ([1.0, "yes", 0.0], "not a number"), (3.0, "returned a float")]:
        with pytest.raises(RewardError, match=message):
            check_rewards(values, 3, "f", 7)


def test_unscorable_completions_are_left_out_of_the_baseline():
    per_function = torch.tensor([[1.0, math.nan], [0.0, 2.0], [math.nan, math.nan], [1.0, 0.0]])
    total = Scores(per_function, torch.tensor([1.0, 0.5]), ("a", "b")).total
    assert total[:2].tolist() == [1.0, 1.0] and math.isnan(total[2]) and total[3] == 1.0
    advantages = group_advantages(torch.tensor([1.0, 3.0, math.nan, 2.0]), 4, allow_unscorable=True)
    # mean and std of {1, 3, 2} only; the unscorable one gets 0, as in TRL
    assert torch.allclose(advantages, torch.tensor([-1.0, 1.0, 0.0, 0.0]), atol=1e-3)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, math.nan]), 2)


def test_scale_rewards_batch_and_none():
    rewards = torch.tensor([0.0, 1.0, 0.0, 3.0])
    batch = group_advantages(rewards, 2, scale="batch")
    assert torch.allclose(batch, torch.tensor([-0.5, 0.5, -1.5, 1.5]) / (rewards.std() + 1e-4))
    assert group_advantages(rewards, 2, scale="none").tolist() == [-0.5, 0.5, -1.5, 1.5]
    assert group_advantages(rewards, 2, scale=False).tolist() == [-0.5, 0.5, -1.5, 1.5]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_loss_types_match_trl_over_ranks_and_micro_batches(loss_type):
    """TRL's aggregation of the per-token loss, computed on the whole batch, equals the sum of the
    rows' (masked sum / denominator) over two micro-batches, averaged over two ranks."""
    torch.manual_seed(0)
    rows, width, max_new = 8, 6, 6
    logprobs = torch.randn(rows, width)
    advantages = torch.randn(rows)
    mask = (torch.arange(width) < torch.randint(1, width + 1, (rows, 1))).float()
    per_token = -(torch.exp(logprobs - logprobs.detach()) * advantages[:, None])
    trl = {"grpo": ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean(),
           "dapo": (per_token * mask).sum() / mask.sum(),
           "dr_grpo": (per_token * mask).sum() / (rows * max_new)}[loss_type]
    total = 0.0
    for rank in range(2):  # each rank holds half the rows and splits them into two micro-batches
        mine = slice(rank * 4, rank * 4 + 4)
        den = loss_denominators(loss_type, mask[mine], global_tokens=float(mask.sum()), global_sequences=rows,
                                max_new_tokens=max_new, ranks=2)
        for part in (slice(0, 2), slice(2, 4)):
            lp = logprobs[mine][part]
            total += grpo_loss(lp, lp.detach(), advantages[mine][part], mask[mine][part],
                               num_tokens=den[part]).loss.item() / 2
    assert total == pytest.approx(trl.item(), rel=1e-5)


# -- the built-in toy task -----------------------------------------------------------------------
def test_toy_task_rewards_and_deterministic_prompts():
    task = ToyTask(vocab_size=64, prompt_len=5, modulus=4, seed=3)
    assert task.prompts(7, 4) == task.prompts(7, 4) != task.prompts(8, 4)
    assert all(len(p) == 5 and all(0 <= t < 64 for t in p) for p in task.prompts(1, 10))
    assert task.rewards([[1]] * 3, [[0, 4, 8, 1], [1, 2, 3], []]) == [0.75, 0.0, 0.0]


def test_a_ranks_batch_is_its_share_checked_and_so_is_each_extra_generation_of_dynamic_sampling():
    from types import SimpleNamespace
    from colo.grpo.distributed import World
    from colo.grpo.dynamic_sampling import EXTRA_STEPS, extra_batch
    from colo.grpo.task import CallableTask, rank_batch

    # Prompts of a real step fit the engine; those of the steps only dynamic sampling's extra generations draw do not.
    task = CallableTask(lambda step, count: [[step % 50 + 1] * (3 if step < EXTRA_STEPS else 30)] * count,
                        lambda prompts, completions: [0.0] * len(completions))
    config = GRPOConfig(prompts_per_step=5, num_generations=2, max_new_tokens=4, dynamic_sampling=1)
    engine = SimpleNamespace(vocab_size=64, max_model_len=16)
    shares = [rank_batch(task, config, World(rank, 2, rank), 7, engine) for rank in (0, 1)]
    assert [rows for rows, _, _ in shares] == [[0, 1, 2], [3, 4]]  # uneven: the first rank takes the extra prompt
    assert [len(sampling) for _, _, sampling in shares] == [3, 2]
    assert len({s["seed"] for _, _, sampling in shares for s in sampling}) == 5
    with pytest.raises(ValueError, match=f"prompt 0 of step {7 + EXTRA_STEPS} has 30 tokens"):
        extra_batch(7, 1, task=task, config=config, world=World(0, 1, 0), engine=engine)


# -- datasets through the real tokenizer -----------------------------------------------------------
def test_chat_prompts_go_through_the_template_and_columns_reach_the_rewards(tokenizer, tmp_path):
    seen = {}

    def spy(prompts, completions, completion_ids, answer, level, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, level=level, extra=kwargs)
        return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

    task = DatasetTask(write_jsonl(tmp_path / "d.jsonl", chat_rows()), tokenizer, [spy, "math"], [1.0, 2.0])
    text = tokenizer.decode(task.prompt_token_ids[3])
    assert text.endswith("<|im_start|>user\nWhat is 3 + 3?<|im_end|>\n<|im_start|>assistant\n"), text
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in task.stop_token_ids and tokenizer.eos_token_id in task.stop_token_ids
    answer_ids = tokenizer("6", add_special_tokens=False)["input_ids"] + [im_end]
    scores = task.score(1, [3, 3], [task.prompt_token_ids[3]] * 2,
                        [answer_ids, tokenizer("7", add_special_tokens=False)["input_ids"]])
    assert scores.names == ("spy", "math")
    assert scores.per_function.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert scores.total.tolist() == [3.0, 0.0]
    assert seen["answer"] == ["6", "6"] and seen["level"] == [3, 3] and seen["extra"] == {}
    assert seen["prompts"][0] == [{"role": "user", "content": "What is 3 + 3?"}]
    assert seen["completions"][0] == [{"role": "assistant", "content": "6"}]  # EOS not in the text


def test_text_prompts_and_every_file_format(tokenizer, tmp_path):
    import datasets

    rows = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(4)]
    ds = datasets.Dataset.from_list(rows)
    paths = [write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "d.csv", tmp_path / "d.parquet", tmp_path / "disk"]
    ds.to_csv(str(paths[1]))
    ds.to_parquet(str(paths[2]))
    ds.save_to_disk(str(paths[3]))
    for path in paths:
        task = DatasetTask(path, tokenizer, "gsm8k")
        assert not task.conversational
        assert tokenizer.decode(task.prompt_token_ids[2]) == "2 + 2 =", path
        assert [str(a) for a in task.columns["answer"]] == ["0", "2", "4", "6"], path
        assert task.stop_token_ids == (tokenizer.eos_token_id,)  # no chat template: EOS only
    with pytest.raises(ValueError, match="unknown format"):
        load_dataset_file(write_jsonl(tmp_path / "d.txt", rows))


def test_arithmetic_few_shot_writes_text_prompts_scored_by_their_first_number(tokenizer, tmp_path, capsys):
    arithmetic.main([str(tmp_path), "--few-shot", "3", "--train", "6", "--eval", "2"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "train.jsonl"), str(tmp_path / "eval.jsonl")]
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:  # three solved problems, one a line, then the question; all of them right
        *solved, question = row["prompt"].split("\n")
        assert len(solved) == 3 and question.endswith(" =")
        for line in [*solved, f"{question} {row['answer']}"]:
            a, op, b, equals, result = line.split(" ")
            assert op in "+*" and equals == "=" and 1 <= int(a) <= 20 and 1 <= int(b) <= 20, line
            assert int(result) == (int(a) + int(b) if op == "+" else int(a) * int(b)), line
    task = DatasetTask(tmp_path / "train.jsonl", tokenizer, "colo.grpo.arithmetic:first_number")
    assert not task.conversational and tokenizer.decode(task.prompt_token_ids[0]) == rows[0]["prompt"]
    gold = rows[0]["answer"]
    completions = [f" {gold}\n1 + 1 = 2", f" {int(gold) + 1}\n2 * 3 = {gold}", "\n"]
    scores = task.score(1, [0] * 3, [task.prompt_token_ids[0]] * 3,
                        [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions])
    assert scores.total.tolist() == [1.0, 0.0, 0.0]  # the first number counts, not the last
    with pytest.raises(SystemExit) as refused:
        arithmetic.main([str(tmp_path), "--few-shot", "2", "--tool-sums"])
    assert refused.value.code == 2 and "--few-shot" in capsys.readouterr().err


def test_rows_are_a_seeded_shuffle_per_epoch(tokenizer, tmp_path):
    task = DatasetTask(write_jsonl(tmp_path / "d.jsonl", chat_rows(5)), tokenizer, "math", seed=3)
    epoch = task.rows(1, 2) + task.rows(2, 2) + task.rows(3, 2)[:1]  # positions 0-4 of the run
    assert sorted(epoch) == [0, 1, 2, 3, 4]  # every row once per epoch
    assert task.rows(2, 2) == DatasetTask(task.dataset, tokenizer, "math", seed=3).rows(2, 2)  # resume: same rows
    assert task.rows(4, 5) != task.rows(1, 5) or task.rows(4, 5) != task.rows(7, 5)  # a new shuffle each epoch


def test_a_list_of_row_dicts_is_a_dataset_and_other_objects_are_refused_by_type(tokenizer, tmp_path):
    rows = chat_rows(4)
    listed = DatasetTask(rows, tokenizer, "math", seed=1)
    from_file = DatasetTask(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, "math", seed=1)
    assert listed.prompt_token_ids == from_file.prompt_token_ids and listed.rows(1, 4) == from_file.rows(1, 4)
    with pytest.raises(TypeError, match="dataset must be .* a list of row dicts, got dict"):
        DatasetTask({"prompt": ["x"]}, tokenizer, "math")


def test_bad_datasets_and_prompts_are_refused_naming_the_row(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="no 'prompt' column .*question"):
        DatasetTask(write_jsonl(tmp_path / "a.jsonl", [{"question": "x"}]), tokenizer, "math")
    long_row = chat_rows(3)
    long_row[2]["prompt"][0]["content"] = "many words " * 50
    path = write_jsonl(tmp_path / "b.jsonl", long_row)
    with pytest.raises(ValueError, match="row 2: prompt of .* tokens is longer than max_prompt_length=40"):
        DatasetTask(path, tokenizer, "math", max_prompt_length=40)
    cut = DatasetTask(path, tokenizer, "math", max_prompt_length=40, truncate="left")
    full = DatasetTask(path, tokenizer, "math")
    assert cut.prompt_token_ids[2] == full.prompt_token_ids[2][-40:] and cut.prompt_token_ids[0] == full.prompt_token_ids[0]
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        DatasetTask(path, tokenizer, "math", [1.0, 2.0])


def test_a_reward_that_raises_names_the_function_step_and_row(tokenizer, tmp_path):
    def picky(completions, level, **kwargs):
        if 3 in level:
            raise KeyError("level 3")
        return [0.0] * len(completions)

    task = DatasetTask(write_jsonl(tmp_path / "d.jsonl", chat_rows()), tokenizer, picky)
    ids = [tokenizer("1")["input_ids"]] * 3
    with pytest.raises(RewardError, match=r"'picky' raised KeyError.* at step 37, on dataset row 3 \(completion 2"):
        task.score(37, [1, 2, 3], [task.prompt_token_ids[r] for r in (1, 2, 3)], ids)


# -- the CLI refuses before any engine starts --------------------------------------------------------
def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "colo.grpo", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def cli_in_this_process(argv, capsys) -> tuple[int, str]:
    """`python -m colo.grpo ARGV`'s exit status and stderr, run in this process (for refusals that come
    before any engine starts: no vLLM start-up to pay per case)."""
    try:
        status = cli.run_cli(list(argv))
    except SystemExit as e:  # argparse's errors
        status = e.code
    return status, capsys.readouterr().err


def test_cli_refuses_bad_task_flags_up_front(smollm2_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows())
    common = ["--steps", "1", "--json", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "out")]
    model = ["--model", str(smollm2_model_dir)]
    for extra, message in [
        ([*model, "--dataset", str(data), "--reward", f"{tmp_path}/nope.py:f"], "no file"),
        ([*model, "--dataset", str(data)], "at least one --reward"),
        ([*model, "--dataset", str(write_jsonl(tmp_path / "q.jsonl", [{"q": 1}])), "--reward", "math"],
         "no 'prompt' column"),
        (["--reward", "math"], "--reward needs --dataset"),
        ([*model, "--dataset", str(data), "--reward", "math", "--reward-weights", "1", "2"], "2 weights for 1"),
        ([*model, "--dataset", str(data), "--reward", "math", "--eval-every", "2"], "--eval-every needs --eval-dataset"),
        ([*model, "--dataset", str(data), "--reward", "math", "--eval-on-start"], "--eval-on-start needs --eval-dataset"),
        ([*model, "--dataset", str(data), "--reward", "math", "--loss-type", "ppo"], "invalid choice"),
    ]:
        status, stderr = cli_in_this_process([*common, *extra], capsys)
        assert status == 2 and message in stderr, (extra, stderr[-800:])
    done = run_cli(*common, "--reward", "math")  # and as a user runs it: the same status and message
    assert done.returncode == 2 and "--reward needs --dataset" in done.stderr, done.stderr[-800:]


def test_a_library_error_is_said_in_the_command_lines_words():
    from colo.grpo.settings import as_flags

    assert as_flags("num_iterations=2 with overlap='on': a rollout", GRPOConfig) == \
        "--num-iterations 2 with --overlap on: a rollout"
    assert as_flags("beta must be >= 0, got -1; temperature must be > 0", GRPOConfig) == \
        "--beta must be >= 0, got -1; --temperature must be > 0"
    assert as_flags("learning_rate must be > 0", GRPOConfig) == "--lr must be > 0"   # the flag, not the field
    assert as_flags("with share_check=False and mask_truncated=True", GRPOConfig) == \
        "with --no-share-check and --mask-truncated"
    assert as_flags("the overlap is off; x=3 and seed_of=2", GRPOConfig) == "the overlap is off; x=3 and seed_of=2"


def test_cli_config_file_fills_flags_under_the_command_line(tmp_path):
    from colo.grpo.cli import build_parser, parse_args

    config = tmp_path / "run.yaml"
    config.write_text("steps: 5\njson: log.jsonl\nout: ckpt\nloss-type: grpo\nreward: [math, gsm8k]\n"
                      "temperature: 0.7\nmask_truncated: true\n")
    args = parse_args(build_parser(), ["--config", str(config), "--temperature", "0.9"])
    assert (args.steps, args.log, args.loss_type, args.reward, args.temperature, args.mask_truncated) == \
        (5, "log.jsonl", "grpo", ["math", "gsm8k"], 0.9, True)
    # TRL's names of the settings both have, as a TRL config file writes them
    config.write_text("vllm_importance_sampling_mode: token_truncate\nvllm_importance_sampling_clip_max: 2.0\n"
                      "eval_steps: 5\nmax_completion_length: 64\nmask_truncated_completions: true\n")
    args = parse_args(build_parser(), ["--config", str(config), "--steps", "1", "--json", "l", "--out", "o"])
    assert (args.importance_sampling, args.importance_sampling_max, args.eval_every, args.max_new_tokens,
            args.mask_truncated) == ("token_truncate", 2.0, 5, 64, True)
    config.write_text("stepz: 5\n")
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["--config", str(config), "--steps", "1", "--json", "l", "--out", "o"])


def test_config_rejects_bad_values():
    for completions in (0, 1):  # one completion per prompt: every advantage 0 (TRL refuses it too)
        with pytest.raises(ValueError, match=r"num_generations \(completions per prompt.*an integer >= 2, got"):
            GRPOConfig(num_generations=completions)
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(temperature=0.0)
    with pytest.raises(ValueError, match="offload_optimizer"):
        GRPOConfig(offload_optimizer="yes")
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp32"):
        GRPOConfig(dtype="float16")
    with pytest.raises(ValueError, match="sync_ref_model with beta=0: there is no reference to move"):
        GRPOConfig(sync_ref_model=True)
    with pytest.raises(ValueError, match="sync_ref_model with lora_rank > 0"):
        GRPOConfig(sync_ref_model=True, beta=0.1, lora_rank=4)
    with pytest.raises(ValueError, match="off_policy_mask_threshold must be > 0"):
        GRPOConfig(off_policy_mask_threshold=0.0)
    assert GRPOConfig(dtype="fp32").resolve_dtype("unused").dtype == "fp32"
    assert GRPOConfig.from_dict(GRPOConfig(seed=4).to_dict()) == GRPOConfig(seed=4)
    assert GRPOConfig.from_dict(GRPOConfig(offload_optimizer=True).to_dict()).offload_optimizer is True
    for bad in (3, (1, 2, 3), "1,2", (0, 1), (1.5, 1)):
        with pytest.raises(ValueError, match="overlap_threads must be"):
            GRPOConfig(overlap_threads=bad)
    # A run's config is saved as JSON (a list) and read back as the pair.
    saved = json.loads(json.dumps(GRPOConfig(overlap_threads=(1, 2)).to_dict()))
    assert GRPOConfig.from_dict(saved).overlap_threads == (1, 2)


def _cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_cli_bad_arguments_fail_fast_with_a_message(tmp_path, capsys):
    base = ["--json", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "out")]
    assert "must be at least 1" in _cli_error(capsys, ["--steps", "0", *base])
    assert "positive integer" in _cli_error(capsys, ["--steps", "x", *base])
    assert "ENGINE,TRAINER" in _cli_error(capsys, ["--steps", "3", "--overlap-threads", "2", *base])
    assert "must be at least 1" in _cli_error(capsys, ["--steps", "3", "--overlap-threads", "1,0", *base])
    assert "no such directory" in _cli_error(capsys, ["--steps", "3", "--model", str(tmp_path / "missing"), *base])
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _cli_error(capsys, ["--steps", "3", "--model", str(tmp_path / "empty"), *base])
    # What colo does not train, refused before any engine: an encoder, an encoder-decoder model, a
    # config that contradicts itself.
    for name, config, said in [
            ("encoder", {"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "not a causal language model"),
            ("seq2seq", {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, "encoder-decoder"),
            ("contradiction", {"model_type": "qwen2", "architectures": ["LlamaForCausalLM"]}, "contradicts itself")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        error = _cli_error(capsys, ["--steps", "3", "--model", str(tmp_path / name), *base])
        assert said in error, error
    assert "run.json" in _cli_error(capsys, ["--steps", "3", "--resume", *base])
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"model_dir": str(tmp_path), "config": {}}))
    (out / "step-000002.pt").write_bytes(b"garbage")
    assert "is not a colo GRPO checkpoint (step-N.pt), or is damaged" in _cli_error(capsys, ["--steps", "3", "--resume", *base])
    # A new run must not overwrite the checkpoints of another.
    assert "already holds checkpoints" in _cli_error(capsys, ["--steps", "3", *base])


def test_a_regex_that_does_not_compile_is_refused_before_any_engine(tmp_path, capsys):
    base = ["--json", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "out")]
    error = _cli_error(capsys, ["--steps", "3", "--structured-outputs-regex", "(unclosed[0-9", *base])
    assert "structured_outputs_regex '(unclosed[0-9' is not a regular expression" in error


def test_a_request_vllm_refuses_is_the_users_error_and_no_reason_to_rebuild_the_engine():
    from vllm.exceptions import VLLMValidationError

    from colo.grpo.rollout_engine import engine_error

    refused = VLLMValidationError("Grammar error: unclosed bracket", parameter="structured_outputs")
    with pytest.raises(ValueError, match="step 3: vLLM refused the run's requests: Grammar error"):
        engine_error(refused, step=3)  # raised, where an engine's own error is returned for a rebuild
    assert engine_error(RuntimeError("engine died"), step=3) == "RuntimeError: engine died"


def test_scheduler_refuses_an_encoder_before_starting_an_engine(tmp_path, monkeypatch):
    from transformers import BertConfig, BertForMaskedLM

    from colo.grpo import scheduler as scheduler_module

    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(tmp_path)
    started = []
    monkeypatch.setattr(scheduler_module, "RolloutEngine", lambda *a, **k: started.append(1))
    with pytest.raises(NotImplementedError, match="BertForMaskedLM is not a causal language model"):
        scheduler_module.GRPOScheduler(tmp_path, lambda p, c: [0.0] * len(c), lambda step, n: [[1, 2]] * n)
    assert not started


def test_a_prompt_longer_than_the_model_is_refused_before_any_engine(smollm2_model_dir, tmp_path):
    from colo.grpo import GRPOConfig
    from colo.grpo.scheduler import GRPOScheduler

    rows = chat_rows(3)
    rows[1]["prompt"][0]["content"] = "word " * 300
    config = GRPOConfig(max_new_tokens=8000, prompts_per_step=2, num_generations=2)  # SmolLM2 has 8192 positions
    with pytest.raises(ValueError, match=r"dataset row 1: prompt of 3\d\d tokens \+ max_new_tokens=8000 exceeds the "
                                         "model's 8192 positions"):
        GRPOScheduler(smollm2_model_dir, config=config, dataset=write_jsonl(tmp_path / "d.jsonl", rows),
                      reward_funcs=["math"])
    with pytest.raises(ValueError, match="eval_every=2 needs an eval_dataset"):
        GRPOScheduler(smollm2_model_dir, config=GRPOConfig(eval_every=2), dataset=tmp_path / "d.jsonl",
                      reward_funcs=["math"])
    with pytest.raises(ValueError, match="eval_on_start needs an eval_dataset"):
        GRPOScheduler(smollm2_model_dir, config=GRPOConfig(eval_on_start=True), dataset=tmp_path / "d.jsonl",
                      reward_funcs=["math"])


def test_plot_draws_a_run_log(tmp_path):
    from colo.grpo.plot import main

    log = tmp_path / "log.jsonl"
    records = [{"step": s, "reward_mean": s / 10, "reward_std": 0.1, "rewards/math/mean": s / 10,
                "rewards/fmt/mean": 0.5, "completion_length_mean": 10 - s, "completion_length_min": 2,
                "completion_length_max": 12, "clipped_ratio": 0.5 / s, **({"eval/math": 0.3} if s == 2 else {})}
               for s in (1, 2, 3)]
    records.insert(0, {"step": 0, "eval/math": 0.1, "eval_s": 1.0})  # --eval-on-start: no step's fields
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "rew')  # killed mid-line
    assert main([str(log), "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "d.png")])
    for record in records[1:]:
        record["step_s"] = 1.5
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(other), str(other), "--labels", "bf16", "fp32", "-o", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):   # a label per log
        main([str(other), str(other), "--labels", "bf16", "-o", str(tmp_path / "e.png")])


def _model_copy(source: Path, target: Path, weights: bytes | None = None, **config) -> Path:
    """`source`'s config (with `config`'s fields changed) and tokenizer in `target`; `weights`: the bytes of
    its model.safetensors (None: no weights at all)."""
    import shutil

    target.mkdir()
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith((".safetensors", ".bin")):
            shutil.copy(file, target / file.name)
    fields = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**fields, **config}))
    if weights is not None:
        (target / "model.safetensors").write_bytes(weights)
    return target


def test_cli_refuses_bad_input_before_any_engine_naming_it(smollm2_model_dir, tmp_path, capsys):
    """What a user gets wrong is refused in words, exit status 2, before any engine starts: values of the
    wrong shape in --config, models transformers cannot read or without readable weights, output paths
    that are directories, reward functions TRL's call cannot reach or whose column the dataset lacks,
    non-finite numbers, generation settings vLLM refuses, and a --resume asking for other settings."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows())   # prompt and answer columns
    common = ["--steps", "1", "--json", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "out")]
    task = ["--model", str(smollm2_model_dir), "--dataset", str(data)]
    yaml = tmp_path / "run.yaml"
    yaml.write_text("lr: [0.001]\n")
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def one_arg(x):\n    return [1.0]\n\ndef picky(completions, solution, **kwargs):\n"
                       "    return [1.0] * len(completions)\n")
    bad_heads = _model_copy(smollm2_model_dir, tmp_path / "heads", b"", num_attention_heads=7)
    no_weights = _model_copy(smollm2_model_dir, tmp_path / "empty")
    garbage = _model_copy(smollm2_model_dir, tmp_path / "garbage", b"not a safetensors file")
    corrupt = tmp_path / "corrupt-rm"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    (tmp_path / "a-dir").mkdir()
    import transformers

    unserved = tmp_path / "openai-gpt"   # a causal LM transformers has and vLLM serves in no way
    transformers.OpenAIGPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                 architectures=["OpenAIGPTLMHeadModel"]).save_pretrained(unserved)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for extra, message in [
        (["--config", str(yaml)], f"--config: {yaml}: lr: expects one value, got a list [0.001]"),
        (["--model", str(bad_heads)], "config.json: "),
        (["--model", str(no_weights)], "holds no weights"),
        (["--model", str(unserved)], "vLLM serves none of its architectures (OpenAIGPTLMHeadModel)"),
        (["--model", str(garbage)], "is not a readable safetensors file"),
        ([*task, "--reward", f"model:{corrupt}"], f"--reward: reward model {corrupt}: cannot read"),
        ([*task, "--reward", "math", "--json", str(tmp_path / "a-dir")], "is a directory; it names a file"),
        ([*task, "--reward", "math", "--trace", str(tmp_path / "a-dir")], "--trace"),
        ([*task, "--reward", f"{rewards}:one_arg"], "'one_arg' cannot take TRL's call"),
        ([*task, "--reward", f"{rewards}:picky"], "'picky' cannot take TRL's call"),
        ([*task, "--reward", "gsm8k", "--dataset", str(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1"}]))],
         "reward function 'gsm8k' needs a 'answer' column"),
        ([*task, "--reward", "math", "--reward-weights", "nan"], "every weight must be a finite number"),
        (["--beta", "nan"], "beta must be a finite number"),
        (["--lr", "inf"], "--lr must be a finite number"),   # (the flag, not the config field)
        (["--importance-sampling", "token_truncate", "--importance-sampling-max", "-1"],
         "--importance-sampling-max must be > 0 or None, got -1.0"),
        (["--generation-kwargs", '{"presence_penalty": 5}'], "vLLM's SamplingParams refuses them"),
        ([*task[:2], "--dataset", str(empty), "--reward", "math"], "the file is empty"),
        ([*task, "--reward", "math", "--lora-rank", "4", "--lora-targets", "bogus_proj"],
         "no linear layer of the model is named one of ['bogus_proj'] (its linear layers: down_proj, gate_proj"),
    ]:
        status, stderr = cli_in_this_process([*common, *extra], capsys)
        assert status == 2 and message in stderr, (extra, stderr[-800:])
    assert "StrictDataclass" not in cli_in_this_process([*common, "--model", str(bad_heads)], capsys)[1][:30]

    # YAML values take each flag's shape: one value for a list flag, words for a switch.
    yaml.write_text("lora_targets: q_proj\nlog_completions: 'no'\nadam_betas: [0.9, 0.99]\n")
    args = cli.parse_args(cli.build_parser(), [*common, "--config", str(yaml)])
    assert (args.lora_targets, args.log_completions, args.adam_betas) == (["q_proj"], False, [0.9, 0.99])

    # --resume continues with run.json's settings: a flag asking for another is refused, naming it.
    out = tmp_path / "resumed"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"model": None, "model_dir": str(out / "toy-model"),
                                              "config": GRPOConfig(learning_rate=3e-3).to_dict(), "task": {}}))
    resume = ["--steps", "2", "--json", str(tmp_path / "log.jsonl"), "--out", str(out), "--resume"]
    status, stderr = cli_in_this_process([*resume, "--lr", "5", "--num-generations", "3"], capsys)
    assert status == 2 and "--lr (5.0; the run has 0.003)" in stderr and "--num-generations (3; the run has 8)" in stderr
    status, stderr = cli_in_this_process([*resume, "--model", str(smollm2_model_dir)], capsys)
    assert status == 2 and "--resume continues the run with its own model" in stderr, stderr
    status, stderr = cli_in_this_process([*resume, "--lr", "0.003"], capsys)   # the same value: not a change
    assert status == 2 and "its own settings" not in stderr and "--resume" in stderr


def test_async_reward_functions_are_awaited_and_strings_are_not_rewards(tmp_path):
    """TRL awaits async reward functions (together); colo too. A string is no list of rewards, though it
    has a length and each character reads as a number."""
    import asyncio

    from transformers import AutoTokenizer

    from colo.smollm2 import smollm2_dir

    async def slow_length(completions, **kwargs):
        await asyncio.sleep(0.01)
        return [float(len(c[0]["content"])) for c in completions]

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    task = DatasetTask(write_jsonl(tmp_path / "d.jsonl", chat_rows()), tokenizer, [slow_length, "math"])
    ids = [tokenizer("12")["input_ids"], tokenizer("1")["input_ids"]]
    scores = task.score(1, [0, 1], [task.prompt_token_ids[r] for r in (0, 1)], ids)
    assert scores.per_function[:, 0].tolist() == [2.0, 1.0]
    with pytest.raises(RewardError, match="returned a str"):
        check_rewards("111", 3, "f", 1)
