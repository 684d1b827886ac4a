#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels bench/gpu_check.sh installs on a GPU
# host that has none (CPython 3.12, x86_64 Linux, its own torch): what such an image lacks
# (aiomqtt, amqtt and its dependencies, grpcio-health-checking, pytest-asyncio, cryptography)
# and what the generated swarm/proto code demands at the versions CI uses (grpcio, protobuf).
# No torch, no numpy: the host's are the ones under test. About 25 MiB.
#
#   bench/gpu_wheels.sh [DIR]     # default .whl (ignored by git); then carry DIR to the host
#
# Versions: constraints.txt where it pins them, else those CI's environment resolved.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
PACKAGES=(
  # pinned by the generated code and CI (constraints.txt)
  grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.36.2
  # the suite's runner: pytest-asyncio needs pytest >= 8.4; installed over the host's
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-asyncio==1.5.0 pytest-timeout==2.4.0
  packaging==26.4 pygments==2.21.0
  # the bus: the client library and the embedded broker
  aiomqtt==2.5.1 paho-mqtt==2.2.0 amqtt==0.12.1
  dacite==1.9.2 psutil==7.2.2 pwdlib==0.3.1 argon2-cffi==25.1.0 argon2-cffi-bindings==26.2.0
  pyyaml==6.0.4 transitions==0.9.3 six==1.17.0 websockets==15.0.1 typing-extensions==4.16.0
  typer==0.29.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2
  annotated-doc==0.0.7
  # `swarm certs` and TLS (the test suite's configuration imports it)
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  # the rest of pyproject's dependencies, should the image lack them
  prometheus-client==0.26.0 tqdm==4.70.1 safetensors==0.8.0
  # the device check's `gpu idle` part samples the stage servers with it (bench/spy.py)
  py-spy==0.4.3
)
mkdir -p "$DIR"
for spec in "${PACKAGES[@]}"; do
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DIR" "$spec"
done
ls "$DIR" | wc -l | xargs echo "wheels in $DIR:"
du -sh "$DIR"
