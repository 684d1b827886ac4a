# Everything runs from .venv, which `make install` creates (the pinned CPU torch first: an unpinned
# torch would pull the multi-gigabyte CUDA build).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.*
# The index torch comes from (empty: pip's own, as CI configures it): a GPU host names PyTorch's
# for its CUDA, e.g. `make install TORCH_INDEX=https://download.pytorch.org/whl/cu128`.
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed

.PHONY: install mosquitto nftables prometheus podman image image-test demo test test-fast check protos bench clean

install: $(STAMP)

# The integration tests start their own Mosquitto brokers: install the Debian package if missing.
mosquitto:
	@command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || { \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq mosquitto >/dev/null; }

# The namespace lab's NAT routers (swarm/local/nat.py) masquerade and firewall with nft.
nftables:
	@command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || { \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq nftables >/dev/null; }

# A test has the real Prometheus server discover a swarm, and promtool lint every /metrics.
prometheus:
	@{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || { 	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; 	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq 	    --no-install-recommends prometheus >/dev/null; }

# The container tests build and run the image with podman (runc, cgroupfs: containers.conf) on a
# base image mmdebstrap makes from Debian's packages: no image registry is needed.
podman:
	@{ command -v podman && command -v runc && command -v mmdebstrap; } >/dev/null 2>&1 || { \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq podman runc mmdebstrap uidmap >/dev/null; }

# The image every role runs from (Containerfile), tagged $(IMAGE); docs/deployment.md, "Containers".
IMAGE ?= swarm:latest
image: install podman
	$(BIN)/python -m tests.support.image --tag $(IMAGE)

# The fast, container-safe tests run inside the image (the Containerfile's `test` stage, built on
# the image every role runs; that image itself stays without pytest and the tests).
image-test: install podman
	$(BIN)/python -m tests.support.image --tag $(IMAGE)-test --target test --run

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: install
	$(BIN)/swarm demo

# Three workers (pytest-xdist) on 2 cores: most of the suite's time is spent waiting on the
# processes a test starts (two workers left the cores idle 28-39% of a run), so a third fills
# the waits: 830 s where two took 980 s (session 103, fresh clones, idle, within the hour; 689
# against 866 s in session 102, 768 against 917 s in session 99), one took ~21-25 minutes.
# Each test runs ~25% longer beside two others:
# the tests that measure speed hold their claims at this load (docs/decisions.md). Every run
# prints its 15 slowest tests. `loadgroup` with no groups (under pytest 9 xdist's groups do not
# group): one test at a time to whichever worker is free, in the suite's order.
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: install mosquitto nftables prometheus podman
	$(BIN)/python -m pytest -q $(XDIST) --durations=15

test-fast: install mosquitto nftables prometheus podman
	$(BIN)/python -m pytest -q $(XDIST) --durations=15 -m "not slow"

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

protos: install
	$(BIN)/python swarm/protogen.py

bench: install
	$(BIN)/python bench/pipeline_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
