"""The KV budget colo.trl gives its engine: the whole generation batch where TRL's memory fraction
allows it, else what fits in it, never less than one full-length sequence."""
import pytest

from colo.kv_sizing import kv_cache_blocks, kv_cache_budget

GiB = 1 << 30
SMOLLM2_FP32_TOKEN = 46080  # 30 layers x K and V x 3 KV heads x 64 x 4 bytes


def test_the_whole_batch_when_it_fits_in_the_fraction():
    nbytes, held = kv_cache_budget(64, 256, 128, SMOLLM2_FP32_TOKEN, memory_fraction=0.3, device_bytes=24 * GiB,
                                   weight_bytes=540 << 20)
    assert nbytes == kv_cache_blocks(64, 256, 128) * 128 * SMOLLM2_FP32_TOKEN and held == 64


def test_the_models_full_length_is_capped_by_the_fraction_less_the_weights():
    # No vllm_max_model_length: SmolLM2's 8192 tokens x 64 sequences would be 22 GiB on a 24 GiB machine.
    weights = 540 << 20
    nbytes, held = kv_cache_budget(64, 8192, 128, SMOLLM2_FP32_TOKEN, memory_fraction=0.3, device_bytes=24 * GiB,
                                   weight_bytes=weights)
    assert nbytes <= 0.3 * 24 * GiB - weights and nbytes > 0.3 * 24 * GiB - weights - 128 * SMOLLM2_FP32_TOKEN
    assert held == (nbytes // (128 * SMOLLM2_FP32_TOKEN) - 1) // 64 and 0 < held < 64


def test_never_less_than_one_full_length_sequence():
    nbytes, held = kv_cache_budget(8, 4096, 16, 1024, memory_fraction=0.01, device_bytes=GiB, weight_bytes=GiB)
    assert nbytes == kv_cache_blocks(1, 4096, 16) * 16 * 1024 and held == 1


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5])
def test_a_fraction_outside_0_to_1_is_refused(fraction):
    with pytest.raises(ValueError, match="memory_fraction"):
        kv_cache_budget(8, 256, 16, 1024, memory_fraction=fraction, device_bytes=GiB, weight_bytes=0)
