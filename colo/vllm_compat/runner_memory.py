"""What vLLM 0.32's model runner allocates inside load_model beside the weights, and so in the pool's
`weights` region (colo's worker places everything made under the "weights" tag there): bytes a caller
that sizes the KV cache itself (colo.grpo's RolloutEngine, colo.plan) must leave for it.

Model Runner V2 (vllm/v1/worker/gpu/; the default on a CUDA GPU where Triton is installed,
VllmConfig.use_v2_model_runner, unless VLLM_USE_V2_MODEL_RUNNER says otherwise) builds its sampler in
load_model, after the weights, whatever the requests will ask for:
- PenaltiesState's output_bin_counts, max_num_seqs x vocab int32 (sample/penalties.py:45), and
  prompt_bin_mask, max_num_seqs x ceil(vocab / 32) int32 (:40);
- the structured-output grammar_bitmask, max_num_seqs x ceil(vocab / 32) int32 without speculative
  decoding (structured_outputs.py:87);
- fixed-width per-request tables (logit_bias.py, bad_words.py, logprob.py): 4481 four-byte elements a
  request.
V1 (vllm/v1/worker/gpu_model_runner.py, and vLLM's CPU runner, its subclass) allocates nothing in
load_model beside the weights: its per-request buffers, input embeddings and block table come from its
__init__, outside the pool, and its vocabulary-sized penalty counts are made per step.
"""
from __future__ import annotations

import importlib.util
import math
import os

_V2_REQUEST_TABLE_BYTES = 4481 * 4


def uses_model_runner_v2(device_type: str) -> bool:
    """Whether vLLM 0.32 runs an engine on this device with Model Runner V2 (colo uses neither pipeline
    parallelism nor speculative decoding, the features that would turn V2's default off)."""
    if device_type != "cuda":
        return False
    setting = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if setting is not None:
        return setting.strip().lower() in ("1", "true")
    return importlib.util.find_spec("triton") is not None


def sampler_buffer_bytes(vocab: int, max_num_seqs: int, device_type: str) -> int:
    """Bytes the model runner allocates in load_model beside the weights (see the module docstring):
    Model Runner V2's sampler buffers where it runs, 0 for V1."""
    return v2_sampler_bytes(vocab, max_num_seqs) if uses_model_runner_v2(device_type) else 0


def v2_sampler_bytes(vocab: int, max_num_seqs: int) -> int:
    """Model Runner V2's sampler buffers: about 324 MiB at 512 sequences x vocab 151936."""
    bitmask_words = math.ceil(vocab / 32)
    return 4 * max_num_seqs * vocab + 2 * 4 * max_num_seqs * bitmask_words + _V2_REQUEST_TABLE_BYTES * max_num_seqs
