#!/usr/bin/env bash
# Before a session's GPU checks (scripts/gpu_check.sh): the packages verispec and its tests need that the lent GPU
# machine's image lacks (it has PyTorch, Triton, tokenizers, safetensors, httpx, pytest and pytest-xdist, and
# reaches no package index), downloaded here as CPython 3.12 wheels into ./.whl, which git ignores.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection gguf "llguidance<2" openai \
  distro jiter sniffio jsonschema jsonschema-specifications referencing rpds-py
du -sh .whl
