#!/usr/bin/env bash
# The device check (issue 41): on a GPU host with no package index, with the host's own torch.
#
#   bench/gpu_check.sh [--device cuda:0|cpu] [--quick] [--budget-s S] [--parts P,Q]
#       [--ratio-shapes long,short] [--smoke-stall-s S] [--plan]
#
# On a lent GPU machine it is one call: 8 minutes at most from this script's start, the wheels'
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

if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/swarm-gpu-site-XXXXXX")
  # The wheels to install: every one the host has no distribution of, and the pinned ones.
  mapfile -t PICK < <("$PY" - "$WHEELS" <<'PYEOF'
import importlib.metadata as md, pathlib, sys
always = {"grpcio", "grpcio_health_checking", "protobuf", "pytest", "pluggy", "iniconfig",
          "pytest_asyncio", "pytest_timeout",
          "websockets", "dacite", "transitions"}  # amqtt's, at the versions it was tested with
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    key = name.lower().replace("-", "_").replace(".", "_")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if key in always or have is None:
        print(whl)
        print(f"  {name} {version} (host: {have or 'none'})", file=sys.stderr)
PYEOF
  )
  echo "installing ${#PICK[@]} carried wheels into $SITE (at most ${WHEELS_S} s)"
  export PIP_ROOT_USER_ACTION=ignore  # a container runs as root; older pips ignore it
  if [ "${#PICK[@]}" -eq 0 ]; then
    :
  elif [ -z "${GPU_CHECK_NO_PIP:-}" ] && "$PY" -m pip --version >/dev/null 2>&1; then
    timeout "$WHEELS_S" "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --disable-pip-version-check --target "$SITE" "${PICK[@]}" \
      || echo "FAIL: pip install"
  else  # no pip: a wheel is a zip of what goes into site-packages (and *.data/purelib|platlib)
    timeout "$WHEELS_S" "$PY" - "$SITE" "${PICK[@]}" <<'PYEOF' || echo "FAIL: unpacking the wheels"
import pathlib, shutil, sys, zipfile
site = pathlib.Path(sys.argv[1])
for whl in sys.argv[2:]:
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
for data in site.glob("*.data"):
    for sub in ("purelib", "platlib"):
        if (data / sub).is_dir():
            shutil.copytree(data / sub, site, dirs_exist_ok=True)
PYEOF
  fi
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # the host image's plugins: see bench/gpu_check.py
exec "$PY" bench/gpu_check.py "$@"
