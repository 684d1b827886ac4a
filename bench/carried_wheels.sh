# The carried wheels (.whl/, bench/gpu_wheels.sh downloads them) installed for a check on a host
# with no package index, sourced by bench/gpu_check.sh and bench/trust_targets.sh: those the host
# lacks, and always grpcio, grpcio-health-checking and protobuf (the generated swarm/proto code
# demands its protobuf), pytest with its plugins, and what only amqtt uses; never torch (the
# host's is the one under test). Into a fresh directory put first on PYTHONPATH; pip where the
# host has it, else the wheels unpacked. Reads PY (the interpreter), WHEELS (the folder; empty:
# nothing installed) and WHEELS_S (the install's seconds).
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
