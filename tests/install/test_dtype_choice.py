"""colo's dtype="auto" (colo.dtype_choice.fastest_dtype) and the AVX2 persona CI runs the kernel- and
dtype-dependent tests under (colo.cpu_persona)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colo import dtype_choice
from colo.cpu_persona import check_machine_has, environment
from colo.dtype_choice import fastest_dtype

REPO = Path(__file__).resolve().parents[2]

# CPU kinds seen on these machines (and one without bf16 but with AVX-512), as torch reports them.
AVX2 = {"architecture": "x86_64", "avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False}
AVX512 = {**AVX2, "avx512_f": True}
AVX512_BF16 = {**AVX512, "avx512_bf16": True}
AMX = {**AVX512_BF16, "amx_tile": True, "amx_bf16": True}


def untimed():
    raise AssertionError("the choice timed a matmul where the CPU's instructions decide it")


@pytest.mark.parametrize("caps,expected", [(AVX2, torch.float32), (AVX512, torch.float32), (AMX, torch.bfloat16),
                                           ({"architecture": "arm64", "bf16": True}, torch.bfloat16),
                                           ({"architecture": "arm64", "bf16": False}, torch.float32)],
                         ids=["avx2", "avx512", "amx", "arm-bf16", "arm"])
def test_bf16_only_where_the_cpu_has_bf16_instructions(monkeypatch, caps, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setattr(dtype_choice, "measured_bf16_slowdown", untimed)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    choice = fastest_dtype("cpu")
    assert choice.dtype == expected and choice.reason and not choice.timed
    assert choice.name == {torch.bfloat16: "bf16", torch.float32: "fp32"}[expected]


@pytest.mark.parametrize("slowdown,expected", [(0.55, torch.bfloat16), (1.65, torch.float32)])
def test_avx512_bf16_without_amx_goes_by_a_timed_matmul(monkeypatch, slowdown, expected):
    """AVX512_BF16 alone does not say which dtype is faster (bf16 on a Zen 5, fp32 on an Intel Xeon whose
    AMX its VM hides): a matmul timed in both decides, and the reason gives the figure."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX512_BF16)
    monkeypatch.setattr(dtype_choice, "measured_bf16_slowdown", lambda: slowdown)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    choice = fastest_dtype("cpu")
    assert choice.dtype == expected and f"took {slowdown:.2f}x fp32's time on one core here" in choice.reason
    assert choice.timed


def test_the_matmul_is_timed_once_per_process(monkeypatch):
    timed = []
    monkeypatch.setattr(dtype_choice, "bf16_slowdown", lambda size: timed.append(size) or 1.5)
    dtype_choice.measured_bf16_slowdown.cache_clear()
    try:
        assert dtype_choice.measured_bf16_slowdown() == dtype_choice.measured_bf16_slowdown() == 1.5
        assert len(timed) == 1
    finally:
        dtype_choice.measured_bf16_slowdown.cache_clear()


def test_onednn_capped_below_bf16_means_fp32(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AMX)
    monkeypatch.setattr(dtype_choice, "measured_bf16_slowdown", untimed)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core")
    assert fastest_dtype("cpu").dtype == torch.float32 and "ONEDNN_MAX_CPU_ISA" in fastest_dtype("cpu").reason
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert fastest_dtype("cpu").dtype == torch.bfloat16


def test_cuda_choice_follows_the_gpus_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    for supported, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
        assert fastest_dtype("cuda").dtype == expected
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        fastest_dtype("meta")


@pytest.mark.cpu_kind
def test_the_choice_agrees_with_the_native_build_vllm_loads():
    """bf16 only where vLLM loads its AVX-512-BF16 build (`_C`, with the sgl kernels): the two read the
    same CPU features, so on the persona both see an AVX2 machine. With that build and no AMX, the
    timed matmul decides."""
    from colo.vllm_compat.forced_kernels import sgl_unavailable_reason
    from helpers.cpu_gemm import onednn_takes

    caps = torch.cpu.get_capabilities()
    if caps.get("architecture") != "x86_64":
        pytest.skip("vLLM's CPU builds are per x86 ISA")
    bf16 = fastest_dtype("cpu").dtype == torch.bfloat16
    bf16_build = sgl_unavailable_reason() == ""
    assert bf16 <= bf16_build
    if bf16_build:
        assert bf16 == (caps.get("amx_bf16") is True or dtype_choice.measured_bf16_slowdown() < 1)
    assert onednn_takes(torch.float32)
    if not torch.cpu.get_capabilities().get("avx512_f"):  # vLLM's AVX2 build: oneDNN refuses bf16
        assert not onednn_takes(torch.bfloat16)


@pytest.mark.parametrize("persona,expected", [("avx2", ["AVX2", False, False, False, "fp32", True]),
                                               ("avx512", ["AVX512", True, False, False, "fp32", True]),
                                               ("avx512_bf16", ["AVX512", True, True, False, None, False])])
def test_a_persona_takes_in_every_process_it_starts(persona, expected):
    """python -m colo.cpu_persona avx2: torch dispatches at AVX2, reports no AVX-512 or AMX, vLLM loads
    its AVX2 build, and auto picks fp32; avx512: AVX-512 without bf16 units or AMX, vLLM's AVX-512 build
    (no sgl kernels), fp32; avx512_bf16: bf16 units without AMX, vLLM's full build (sgl kernels), auto
    by the matmul it times (None: either). In the command and in a Python process it starts in turn."""
    needed = {"avx512": "avx512_f", "avx512_bf16": "avx512_bf16"}.get(persona)
    if needed and not torch.cpu.get_capabilities().get(needed):
        pytest.skip(f"this CPU has no {needed.upper()}: the {persona} persona cannot add it")
    probe = ("import json, torch; from colo.dtype_choice import fastest_dtype; "
             "from colo.vllm_compat.forced_kernels import sgl_unavailable_reason; "
             "print(json.dumps([torch.backends.cpu.get_cpu_capability(), torch.cpu._is_avx512_supported(), "
             "torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported(), "
             "fastest_dtype().name, bool(sgl_unavailable_reason())]))")
    nested = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {probe!r}], check=True)"
    for code in (probe, nested):
        done = subprocess.run([sys.executable, "-m", "colo.cpu_persona", persona, "--", sys.executable, "-c", code],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        assert seen[4] in ("fp32", "bf16") and [s if e is not None else None for s, e in zip(seen, expected)] == expected


def test_persona_refuses_unknown_names_and_missing_commands(tmp_path):
    assert subprocess.run([sys.executable, "-m", "colo.cpu_persona", "avx9", "--", "true"], capture_output=True,
                          text=True, cwd=REPO).returncode == 2
    done = subprocess.run([sys.executable, "-m", "colo.cpu_persona", "avx2"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2 and "usage" in done.stderr
    env = environment("avx2", {"PYTHONPATH": "/elsewhere"})
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["PYTHONPATH"].split(os.pathsep)[1] == "/elsewhere"
    # Caches of its own, as another machine would have: compile caches are not keyed by what it changes.
    env = environment("avx2", {"VLLM_CACHE_ROOT": "/caches/vllm"})
    assert env["VLLM_CACHE_ROOT"] == "/caches/vllm/persona-avx2"
    assert env["TORCHINDUCTOR_CACHE_DIR"].endswith("persona-avx2")
    with pytest.raises(ValueError, match="unknown CPU persona"):
        environment("avx9")
    assert environment("avx512", {})["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx avx2 fma\n")
    check_machine_has("avx2", cpuinfo)
    with pytest.raises(ValueError, match="this CPU has no AVX512F: the avx512 persona can only take instructions away"):
        check_machine_has("avx512", cpuinfo)


@pytest.mark.cpu_kind  # the answer is the CPU kind's
def test_colo_trl_warns_of_bf16_autocast_exactly_where_auto_picks_fp32(monkeypatch):
    """Where auto does not pick bf16 (AVX2 here under the persona pass; an AVX-512-BF16 CPU whose bf16
    matmuls time slower), colo.trl turns auto's reason into one warning with this machine's measured
    cost and the fix, for bf16=True on a CPU only; none where auto picks bf16."""
    from types import SimpleNamespace

    import colo.trl as colo_trl
    from colo.dtype_choice import fastest_dtype, measured_bf16_slowdown

    choice = fastest_dtype("cpu")
    monkeypatch.setattr(colo_trl, "_WARNED", set())
    warning = colo_trl.autocast_warning(SimpleNamespace(bf16=True), "cpu")
    if choice.dtype == torch.bfloat16:
        assert warning is None
        return
    assert choice.reason in warning and "Pass bf16=False" in warning
    assert warning.count("on one core here") == 1  # the measured cost, said once (the timed reason carries it)
    assert colo_trl.autocast_warning(SimpleNamespace(bf16=True), "cpu") is None  # once per process
    monkeypatch.setattr(colo_trl, "_WARNED", set())
    assert colo_trl.autocast_warning(SimpleNamespace(bf16=False), "cpu") is None
    assert measured_bf16_slowdown() > 1  # about 25x where emulated (an AVX2 EPYC), 1.6x on a Xeon without AMX
