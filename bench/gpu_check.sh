#!/usr/bin/env bash
# The device check (issue 41): on a GPU host with no package index, with the host's own torch.
#
#   bench/gpu_check.sh [--device cuda:0|cpu] [--quick] [--budget-s S] [--parts P,Q]
#       [--ratio-shapes long,short] [--smoke-stall-s S] [--plan]
#
# On a lent GPU machine it is one call: 8.5 minutes at most from this script's start, the wheels'
# install included (GPU_CHECK_STARTED carries the start to bench/gpu_check.py, which budgets its
# parts by what is left), and at most 8 files under $OUT.
#
# 1. Installs the wheels carried in .whl/ (bench/gpu_wheels.sh downloads them on a machine with
#    an index) into a fresh directory put first on PYTHONPATH: those the host lacks, and always
#    grpcio, grpcio-health-checking and protobuf (the generated swarm/proto code demands its
#    protobuf), pytest with its plugins (the suite's configuration needs pytest-asyncio), and
#    what only amqtt uses.
#    Never torch: the host's is the one under test. GPU_CHECK_WHEELS= (empty) skips this.
#    The install has WHEELS_S seconds (bench/gpu_check.py's WHEELS_S); --plan installs nothing.
# 2. Runs bench/gpu_check.py: versions; a smoke part (2 steps of swarm, 4 stage servers on the
#    device, both shapes; the check stops there if it fails); swarm against torch
#    (bench/gpu_ratio.py, the long shape first); the CUDA tests; a real out-of-memory
#    mid-backward and float64 on the device against the CPU reference
#    (bench/gpu_fault_check.py). --parts adds the others (doctor, train fp32, train bf16-mixed,
#    llama-1b). Each part says PASS or FAIL with its figures; $OUT/gpu_check.txt gets the
#    summary when OUT is set, each part's log beside it (gpu_check_logs/).
# Exit status: 0 when every part passed. CI runs `bench/gpu_check.sh --device cpu --quick`.
set -u
cd "$(dirname "$0")/.."
export GPU_CHECK_STARTED=${GPU_CHECK_STARTED:-$(date +%s)}
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS-.whl}
WHEELS_S=45
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case " $* " in *" --plan "*) WHEELS= ;; esac  # a plan runs nothing: no install either

. bench/carried_wheels.sh  # the install: PY, WHEELS, WHEELS_S as set above
exec "$PY" bench/gpu_check.py "$@"
