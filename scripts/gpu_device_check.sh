#!/usr/bin/env bash
# The command sent to the GPU machine (the `run` tool, carry=["build/device-wheels"]); docs/gpu-notes.md has the log.
# Here, once: pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#   --platform manylinux_2_17_x86_64 -d build/device-wheels grpcio-health-checking==1.84.0
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    build/device-wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
PYTHONUNBUFFERED=1 python3 scripts/gpu_device_check.py 2>&1 | tee "${OUT:-/tmp}/gpu_device_check.log"
