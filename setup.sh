#!/usr/bin/env bash
# squeeze set-up on a fresh Debian machine (2 cores, no GPU needed): install the dependencies, build
# everything (CUDA translation units too when nvcc is present), and run the main example (LLaMA training).
#   ./setup.sh            # then: ctest --test-dir build -j2 --output-on-failure
# Environment: BUILD_DIR (default build), SKIP_APT=1 / SKIP_PIP=1 to skip installs, SKIP_EXAMPLE=1.
set -euo pipefail
cd "$(dirname "$0")"
BUILD_DIR=${BUILD_DIR:-build}
step() { printf '\n==> %s\n' "$*"; }
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo

if [ "${SKIP_APT:-0}" != 1 ]; then
  step "Debian packages: compilers (clang for the fuzz target), GoogleTest, Google Benchmark, CLI11, nlohmann-json, fmt, OpenSSL, ccache, KJV corpus"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    g++ make cmake python3-pip libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev \
    libfmt-dev libssl-dev libsentencepiece-dev clang libclang-rt-dev ccache bible-kjv-text bible-kjv >/dev/null
fi

if [ "${SKIP_PIP:-0}" != 1 ]; then
  # libtorch from PyPI's torch wheel. --no-deps skips the multi-GB NVIDIA runtime wheels: the C++
  # libraries squeeze links for CPU work (torch_cpu, c10) need none of them. Supported: libtorch 2.4 - 2.x
  # (tested: 2.15 here, 2.11+cu130 on the GPU machine). A CMake >= 3.28 is needed for CUDA C++20. numpy: the
  # GPTQ reimplementation of tools/check_quant_interop.py (ctest quant_interop_numpy_gptq).
  step "PyPI: libtorch (torch wheel, no NVIDIA runtime wheels), CMake >= 3.28, numpy, tokenizers"
  python3 -m pip install -q --no-deps "torch>=2.4,<3" "cmake>=3.28,<5" "numpy>=1.24"
  # tokenizers: tools/tokenize_hf.py (tokenizer.json to token shards) and its ctest hf.tokenize_hf.
  python3 -m pip install -q "tokenizers>=0.15"
fi
CMAKE=$(python3 -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))' 2>/dev/null || command -v cmake)
echo "cmake: $($CMAKE --version | head -1)"

step "configure ($BUILD_DIR)"
"$CMAKE" -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
step "build (2 jobs; the CUDA and libtorch translation units take a few minutes)"
rm -f "$BUILD_DIR/compile_times.log"
"$CMAKE" --build "$BUILD_DIR" -j2
if [ -s "$BUILD_DIR/compile_times.log" ]; then
  step "the slowest translation units (seconds; ccache hits are fast): $BUILD_DIR/compile_times.log"
  sort -rn "$BUILD_DIR/compile_times.log" | head -8 | sed "s|$PWD/||"
fi

if [ "${SKIP_EXAMPLE:-0}" != 1 ]; then
  step "main example: a tiny LLaMA learns the King James Bible on the CPU (bf16 compute, fp32 master, checkpointing)"
  "$BUILD_DIR/bin/llama_train" --preset tiny --strategy bf16-ckpt --steps 60 --batch 8 --seq 128 --eval-every 30
  step "the memory planner: what each strategy costs for LLaMA-7B on 8 GPUs"
  "$BUILD_DIR/bin/plan" --preset llama-7b --world 8
fi
