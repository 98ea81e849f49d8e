#!/usr/bin/env bash
# A lent GPU's checks as one command (the device tool's `run`), in the order that pays, each step under its own
# time limit so that one slow step cannot take the others' time; every log and JSON goes to $OUT (./gpu_out
# elsewhere), at most 8 files. Before the session, here: `bash scripts/gpu_wheels.sh` (the packages the GPU image
# lacks, into ./.whl); then on the device, with carry [".whl"]:
#     bash scripts/gpu_check.sh                        # about 10 minutes: set timeout_s to 600
# MODEL=path/to/a.gguf adds the decode and speculation benchmarks on that model (SmolLM2's GGUF is 98 MB, over one
# call's 64 MiB: carry it in two halves over two calls while the machine stays warm and join them in /tmp).
set -uo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install"; exit 1; }
fi
export PY out PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
failed=0
# PYTHON=.venv/bin/python runs it as a dry run on a machine without a GPU (the CUDA steps skip or fail at once)

step() {  # NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, its tail here
  local name=$1 secs=$2
  shift 2
  echo "== $name ($(date +%T), at most ${secs}s)"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$out/$name.log"
  echo "== $name: rc $rc"
  [ "$rc" -eq 0 ] || failed=1
}

step env 60 bash -c 'nvidia-smi -L; lscpu | grep "Model name"; "$PY" -c "import torch, triton, verispec;
print(\"torch\", torch.__version__, \"triton\", triton.__version__, torch.cuda.get_device_name())"'
# the batch-invariant kernels, bitwise on the GPU (the paged attention against the gathered one among them)
step cuda_ops 180 "$PY" -m pytest -q -p no:cacheprovider -rfE tests/unit/kernels/test_cuda_ops.py
# what reading the blocks in place saves over gathering them, Qwen2.5-Coder-1.5B's and SmolLM2's heads
step cuda_attention 150 bash -c '"$PY" benchmarks/cuda_attention.py --output "$out/cuda_attention.json" &&
  "$PY" benchmarks/cuda_attention.py --heads 9,3,64 --contexts 512,2048 --output "$out/cuda_attention_smollm2.json"'
# greedy output with speculation equal to plain decoding on CUDA: every method, cached prefixes, preemption, and
# two data-parallel replicas sharing the GPU
step lossless 360 "$PY" -m pytest -q -p no:cacheprovider -n 8 -rfE tests/e2e/test_spec_lossless.py \
  tests/e2e/engine/test_prefix_caching.py tests/e2e/proposers/test_method_conformance.py \
  tests/e2e/distributed/test_data_parallel.py
if [ -n "${MODEL:-}" ]; then
  step decode_speed 240 "$PY" benchmarks/decode_speed.py --model "$MODEL" --device cuda --batches 1,8 \
    --no-transformers --no-llama-cpp --no-int8 --output "$out/decode_speed.json"
fi
exit $failed
