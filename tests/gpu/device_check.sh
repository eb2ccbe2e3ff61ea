#!/usr/bin/env bash
# The GPU checks of the checkpoint path in one command, for a machine with a GPU and PyTorch with CUDA but no package
# index (the `device` tool's): the GPU tests (async saves staged into pinned memory on a side stream, resume onto
# the GPU with `ckpt_load_directly_on_device`), the private-API canaries against that machine's torch,
# `ckpt_bench.py --device cuda` (ours against DCP, megatron-core, torch.save and the copy into pinned memory) and
# `train_ckpt_bench.py --device cuda` (what an async checkpoint costs training, with the copies into host memory
# waited for at the save, and overlapping the next forward and backward).
#
#   bash tests/gpu/device_check.sh --fetch-wheels   # here, with the index: the missing packages into .whl/
#   bash tests/gpu/device_check.sh [OUT]            # there, .whl/ carried along: logs into OUT ($OUT, or /tmp)
#
# .whl/ (git-ignored) is for Python 3.12 on x86-64, the GPU machine's.
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(crc32c==2.9.post0 fiddle==0.3.1 graphviz==0.21 libcst==1.9.0 megatron-core==0.19.2)

if [ "${1:-}" = "--fetch-wheels" ]; then
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
fi

out="${1:-${OUT:-/tmp/device_check}}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || {
  echo "device_check: no wheels in .whl/: run 'bash tests/gpu/device_check.sh --fetch-wheels' first and carry .whl"
  exit 1
}
# that machine's torch is not the tested one (constraints.txt): go on, and let the canaries say what differs
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NEMO_CKPT_ALLOW_UNTESTED_VERSIONS=1
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, \
torch.cuda.get_device_name())" 2>&1 | tee "$out/versions.txt"
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/dist_checkpointing/test_staging_buffers.py \
  tests/test_compat.py 2>&1 | tee "$out/tests.log" || status=1
timeout 240 python3 benchmarks/ckpt_bench.py --device cuda --sizes-gib 1 --ranks 1 --reps 3 --dir /tmp/ckpt_bench \
  --no-write 2>&1 | tee "$out/ckpt_bench.log" || status=1
timeout 150 python3 benchmarks/train_ckpt_bench.py --device cuda --ranks 1 --every 10 --checkpoints 4 --reps 2 \
  --seq-length 1024 --micro-batch-size 4 --configs async "async, overlapped staging" --no-write \
  --raw "$out/train_ckpt_bench.json" 2>&1 | tee "$out/train_ckpt_bench.log" || status=1
exit "$status"
