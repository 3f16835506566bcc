"""colo.grpo on a vision-language model: a dataset with TRL's `image` column, the images through the
model's processor into the engine (vLLM's multi_modal_data) and into the trainer's forward, one copy
of the weights; and bad image input refused, naming the row, before any engine starts."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers.images import squares

pytestmark = pytest.mark.slow


def image_rows(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": "How many squares?"}], "image": squares(i % 4 + 1),
             "answer": str(i % 4 + 1)} for i in range(n)]


def test_grpo_trains_a_vision_language_model_with_one_copy(idefics3_dir, tmp_path):
    import datasets
    from PIL import Image

    from colo.grpo import GRPOConfig
    from colo.grpo.scheduler import GRPOScheduler

    seen = {"images": [], "completion_ids": []}

    def first_token_parity(completions, completion_ids, image, answer, **kwargs):
        seen["images"] += image
        seen["completion_ids"] += completion_ids
        return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]

    # fp32 on every CPU kind (auto picks bf16 where the CPU has bf16 instructions): the engine's
    # log-probabilities then equal the trainer's to 1e-4 (bf16: the ZeRO-1 test below).
    config = GRPOConfig(prompts_per_step=2, num_generations=4, max_new_tokens=8, learning_rate=1e-2, seed=0,
                        dtype="fp32")
    # One image in every row: step 2's prompts carry the image step 1's did, whose embeddings vLLM cached
    # (by the image's hash) under step 1's weights.
    rows = [{**row, "image": squares(2)} for row in image_rows(8)]
    scheduler = GRPOScheduler(idefics3_dir, config=config, dataset=datasets.Dataset.from_list(rows),
                              reward_funcs=[first_token_parity], out_dir=tmp_path / "out")
    model = scheduler.model
    tower = model.model.vision_model.embeddings.patch_embedding.weight
    projector = model.model.connector.modality_projection.proj.weight
    before = {"tower": tower.detach().clone(), "projector": projector.detach().clone()}
    try:
        records = [scheduler.train_step() for _ in range(2)]
    finally:
        scheduler.close()
    # The vision tower is frozen by default (still the engine's tensors); the projector trains.
    assert torch.equal(tower, before["tower"]) and not torch.equal(projector, before["projector"])
    assert not tower.requires_grad and projector.requires_grad
    placeholders = set(scheduler.task.placeholder_token_ids())
    assert placeholders and not any(placeholders & set(ids) for ids in seen["completion_ids"])
    assert all(isinstance(image, Image.Image) for image in seen["images"])   # reward functions get the column
    assert records[0]["grad_norm"] > 0                                     # step 1 changed the weights
    for record in records:
        assert record["publish_bytes_copied"] == 0
        # the engine generated step 2 from the weights step 1 published, images included
        assert record["engine_logprob_max_abs_diff"] < 1e-4


def test_bad_image_input_is_refused_before_any_engine(idefics3_dir, smollm2_model_dir, tmp_path, monkeypatch):
    import datasets

    from colo.grpo import scheduler as scheduler_module

    started = []
    monkeypatch.setattr(scheduler_module, "RolloutEngine", lambda *a, **k: started.append(1))

    def build(model_dir, rows):
        return scheduler_module.GRPOScheduler(model_dir, dataset=datasets.Dataset.from_list(rows),
                                              reward_funcs=["math"])

    with pytest.raises(ValueError, match="has an `image` column but the model is text-only"):
        build(smollm2_model_dir, image_rows(2))
    rows = image_rows(3)
    rows[2]["image"] = str(tmp_path / "missing.png")
    with pytest.raises(ValueError, match=r"dataset row 2, image: cannot read the image"):
        build(idefics3_dir, rows)
    two_images = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}],
                   "images": [squares(1), squares(2)], "answer": "1"}]
    with pytest.raises(ValueError, match=r"dataset row 0: 2 images for 1 image placeholders"):
        build(idefics3_dir, two_images)
    text_prompts = [{"prompt": "How many squares?", "image": squares(1), "answer": "1"}]
    with pytest.raises(ValueError, match="its prompts are text: images go into chat prompts"):
        build(idefics3_dir, text_prompts)
    no_processor = tmp_path / "no-processor"
    shutil.copytree(idefics3_dir, no_processor)
    (no_processor / "processor_config.json").unlink()
    with pytest.raises(ValueError, match="no-processor: .*processor"):
        build(no_processor, image_rows(2))
    assert not started


def test_lora_adapts_the_language_model_of_a_vision_language_model(idefics3_dir, tmp_path):
    """LoRA on a vision-language model: the adapter is the engine's slot on the language model's layers
    (vLLM adapts no vision tower or projector layer), 0 bytes per publish, the engine generating the
    next step from the adapter the last one trained."""
    import datasets

    from colo.grpo import GRPOConfig
    from colo.grpo.scheduler import GRPOScheduler

    def first_token_parity(completion_ids, **kwargs):
        return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]

    rows = [{**row, "image": squares(2)} for row in image_rows(8)]
    config = GRPOConfig(prompts_per_step=2, num_generations=4, max_new_tokens=8, learning_rate=1e-2, seed=0,
                        lora_rank=8, dtype="fp32")  # fp32 on every CPU kind, as above
    scheduler = GRPOScheduler(idefics3_dir, config=config, dataset=datasets.Dataset.from_list(rows),
                              reward_funcs=[first_token_parity], out_dir=tmp_path / "out")
    try:
        names = [name for name, _ in scheduler.views.named_parameters()]
        records = [scheduler.train_step() for _ in range(2)]
    finally:
        scheduler.close()
    assert names and all(".text_model." in name and "lora_" in name for name in names)
    assert records[0]["grad_norm"] > 0
    for record in records:
        assert record["publish_bytes_copied"] == 0 and record["engine_logprob_max_abs_diff"] < 1e-4


def test_zero1_on_two_ranks_trains_a_vision_language_model_with_one_copy(idefics3_dir, tmp_path):
    """--shard-optimizer on two ranks on an image dataset: each rank's engine serves the weights the
    all-gather wrote into it (0 bytes per publish, the engine's log-probabilities at step 2 the trainer's
    within bf16 rounding), and OUT/final is the image-text-to-text model with its processor."""
    import json

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from helpers.grpo_runs import records, run_grpo_ranks

    images = tmp_path / "images"
    images.mkdir()
    rows = []
    for i, row in enumerate(image_rows(8)):
        row["image"].save(images / f"{i}.png")
        rows.append({**row, "image": str(images / f"{i}.png")})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "parity.py").write_text("def parity(completion_ids, **kwargs):\n"
                                        "    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]\n")
    out = tmp_path / "out"
    run_grpo_ranks(out, 2, "--model", str(idefics3_dir), "--dataset", str(tmp_path / "train.jsonl"),
                   "--reward", f"{tmp_path / 'parity.py'}:parity", "--steps", "2", "--prompts-per-step", "2",
                   "--num-generations", "4", "--max-new-tokens", "8", "--lr", "1e-2", "--shard-optimizer",
                   "--dtype", "bf16", "--eager")  # a compiled vision-language engine: the in-process tests above
    log = records(out)
    assert [r["step"] for r in log] == [1, 2] and log[0]["grad_norm"] > 0
    assert all(r["publish_bytes_copied"] == 0 for r in log)
    assert log[1]["engine_logprob_max_abs_diff"] < 0.1   # bf16 weights, as the text ZeRO-1 tests bound them
    model = AutoModelForImageTextToText.from_pretrained(out / "final")
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert AutoProcessor.from_pretrained(out / "final").image_token_id == model.config.image_token_id
