"""Run a command as a CPU of another kind would run it, on any x86 machine.

    python -m colo.cpu_persona avx2 -- python -m pytest tests/sharing/test_cpu_gemm_paths.py
    python -m colo.cpu_persona avx2 -- python -m colo.grpo --steps 4 --out /tmp/run
    python -m colo.cpu_persona avx512 -- COMMAND   # an AVX-512 CPU without bf16 units, on one with them
    python -m colo.cpu_persona avx512_bf16 -- COMMAND   # AVX-512-BF16 without AMX, on an AMX machine

CI lands on whichever CPU kind comes (AMD EPYC with AVX2 only, AMD EPYC with AVX-512-BF16, Intel
Xeon with AVX-512F and no bf16 units, Intel Xeon with AVX-512-BF16 or AMX), and they differ where
colo's choices are made: vLLM loads another native build per kind and picks other GEMM kernels, and
torch trains bf16 about 25x slower than fp32 without bf16 instructions. A persona makes the machine
at hand behave like another kind for the three things that decide those, each checked against what it
really changes:

- ATEN_CPU_CAPABILITY: torch's own vectorised kernels dispatch as on that kind
  (`torch.backends.cpu.get_cpu_capability()` reports it);
- ONEDNN_MAX_CPU_ISA: oneDNN (torch's bf16/fp32 matmuls and vLLM's oneDNN linears) uses no
  instruction the kind lacks; bf16 matmuls then run emulated, as slowly as on that kind;
- the CPU features torch reports (`torch.cpu.get_capabilities()`, which vLLM reads to choose its
  native build, `_C_AVX2` on AVX2, and its kernels): the persona's missing features are removed
  from it, in every Python process the command starts (colo/_persona/sitecustomize.py).

The persona cannot add instructions the machine lacks: it only takes some away. And it has compile
caches of its own (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR), as another machine would: their keys
do not hold what the persona changes, and a compiled engine that loaded this machine's code for the
persona's native build served NaN.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# persona -> (environment, CPU feature flags torch.cpu.get_capabilities() reports as absent, the
# /proc/cpuinfo flag the machine needs for it: a persona takes instructions away, it cannot add them)
PERSONAS = {
    "avx2": ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
             ("avx512", "amx", "avx10"), "avx2"),  # every feature whose name starts with one of these
    # An AVX-512 Xeon without bf16 units (Skylake-SP, Cascade Lake): vLLM loads its `_C_AVX512` build.
    "avx512": ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
               ("avx512_bf16", "avx512_fp16", "amx", "avx10"), "avx512f"),
    # AVX-512 with bf16 units and no AMX (AMD Zen 4/5, a Xeon whose VM hides AMX): vLLM's `_C` build, and
    # --dtype auto decides by the matmul it times; on an AMX machine, AMX hidden.
    "avx512_bf16": ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
                    ("amx", "avx10"), "avx512_bf16"),
}


def dispatch_capability(persona: str) -> str:
    """What torch.backends.cpu.get_cpu_capability() says under the persona."""
    return PERSONAS[persona][0]["ATEN_CPU_CAPABILITY"].upper()
PERSONA_VARIABLE = "COLO_CPU_PERSONA"
_HIDES_VARIABLE = "COLO_CPU_PERSONA_HIDES"
_SITE_DIR = Path(__file__).resolve().parent / "_persona"


def active() -> str | None:
    """The persona this process runs as (None: the machine as it is)."""
    return os.environ.get(PERSONA_VARIABLE) or None


def environment(persona: str, base: dict | None = None) -> dict:
    """`base` (default os.environ) with what makes a process, and the processes it starts, run as `persona`."""
    if persona not in PERSONAS:
        raise ValueError(f"unknown CPU persona {persona!r} (known: {', '.join(PERSONAS)})")
    env = dict(os.environ if base is None else base)
    variables = PERSONAS[persona][0]
    env.update(variables)
    home_caches = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    for variable, default in (("VLLM_CACHE_ROOT", os.path.join(home_caches, "vllm")),
                              ("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor"))):
        env[variable] = os.path.join(env.get(variable) or default, f"persona-{persona}")
    env[PERSONA_VARIABLE] = persona
    env[_HIDES_VARIABLE] = ",".join(hidden_features(persona))  # read by _persona/sitecustomize.py
    paths = [str(_SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def hidden_features(persona: str) -> tuple[str, ...]:
    """Prefixes of the CPU feature names the persona's torch.cpu.get_capabilities() reports False."""
    return PERSONAS[persona][1]


def check_machine_has(persona: str, cpuinfo: str = "/proc/cpuinfo") -> None:
    """ValueError where this machine lacks the instructions `persona` keeps (it would run as the machine
    is, not as the persona); nothing to check where /proc/cpuinfo is not there to read."""
    needed = PERSONAS[persona][2]
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path(cpuinfo).read_text().splitlines()
                      if line.startswith("flags")), None)
    except OSError:
        return
    if flags is not None and needed not in flags:
        raise ValueError(f"this CPU has no {needed.upper()}: the {persona} persona can only take instructions "
                         "away, not add them")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        head, command = argv[:split], argv[split + 1:]
    else:
        head, command = argv[:1], argv[1:]
    if len(head) != 1 or not command:
        print(f"usage: python -m colo.cpu_persona {{{','.join(PERSONAS)}}} -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        env = environment(head[0])
        check_machine_has(head[0])
    except ValueError as e:
        print(f"colo.cpu_persona: {e}", file=sys.stderr)
        return 2
    os.execvpe(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
