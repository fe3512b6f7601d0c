#!/usr/bin/env bash
# Write an offline bundle: the wheels vlmrl and benchmarks/gpu_check.py need that an offline target lacks (never a
# torch). Run on a machine that reaches a package index; see scripts/offline_bundle.py --help and docs/scaling.md
# ("Offline cluster").
#   bash scripts/offline_bundle.sh BUNDLE                       # the default target: the GPU machine we expect
#   bash scripts/offline_bundle.sh BUNDLE --has target.txt      # a target's `pip list --format=freeze`
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/offline_bundle.py" "$@"
