"""Helpers shared by several test files (plain functions and constants; the fixtures are in
tests/conftest.py). tests/ is on sys.path because conftest.py lives there, so test files in any
folder import them as `from helpers.<module> import ...`.

    cmake_driver  the repository's CMake driver (buildtools/cmake_build.py), for tests that build
    cpu_gemm      what vLLM's CPU GEMM dispatch does on this machine's build, when forced
    grpo_runs     `python -m colo.grpo` as a subprocess, alone or under torchrun, and its step records
    logprobs      the trainer's log-probabilities of prompts, to compare with what the engine serves
    models        a one-layer Qwen2, smaller than conftest's tiny models, for the trainer's parts
    pools         which pools the pool tests run against
    zero_toy      the toy problem colo.ShardedMasterWeightOptimizer's tests train
    zero_worker   one rank training it (a script: run under torchrun, or alone)
"""
