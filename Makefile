# testbed: a cluster in a box for distributed training.
# `make testbed TOPO=fat-tree` runs the main job; `make test` runs the tests.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
# torch is pinned so a fresh machine here takes the local CPU wheel; GPU users
# override it, e.g. `make venv TORCH_SPEC='torch==2.13.0 --index-url ...'`.
TORCH_SPEC ?= torch==2.13.0
TOPO   ?= fat-tree
NAME   ?=
PY      = $(VENV)/bin/python
TESTBED = $(VENV)/bin/testbed
PYTEST_ARGS ?=
# `make test` runs this many tests at once (pytest-xdist); 1: one at a time
TEST_JOBS ?= 2
SUITE    = $(PY) tests/suite.py --jobs $(TEST_JOBS)

.PHONY: help deps venv testbed down test test-rest test-all test-kernel bench fidelity image doctor clean

help:
	@echo "make testbed TOPO=fat-tree   bring up a topology and run the main training job"
	@echo "make down                    tear down every testbed"
	@echo "make test                    the fast suite (~6 min on 2 cores): all but slow and multi-host tests"
	@echo "make test-rest               the slow and multi-host tests (what make test leaves out)"
	@echo "make test-all                every test: make test's phases, then make test-rest's, in one run"
	@echo "make test-kernel             run the netem tests under a stock kernel (virtme-ng)"
	@echo "make bench                   benchmarks (up/down speed vs Mininet)"
	@echo "make fidelity                the fidelity matrix: measured vs the reference model (~1 h; docs/fidelity.md)"
	@echo "make image                   build the Docker worker image (offline-capable)"
	@echo "make doctor                  what this machine's kernel can do"
	@echo "make deps                    apt packages the tests use (iperf3, ping, nftables, ...)"

# What the tests measure with (Debian/Ubuntu); Docker and the kernel VM stage: see .ci/run.
deps:
	apt-get install -y --no-install-recommends iproute2 iputils-ping iperf3 nftables tcpdump shellcheck ethtool \
	  procps util-linux kmod python3-venv chromium

venv: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test,kernel]'
	@touch $@

testbed: venv
	$(PY) -m testbed.mainjob $(TOPO) $(if $(NAME),--name $(NAME))

down: venv
	$(TESTBED) down --all

doctor: venv
	$(TESTBED) doctor

# The phases and markers: tests/suite.py, tests/conftest.py, docs/HACKING.md. PYTEST_ARGS go to each
# phase (PYTEST_ARGS=tests/test_shaping.py, PYTEST_ARGS='-k delay'); TESTBED_REQUIRE=all: no silent skip.
test: venv
	$(SUITE) fast timing -- $(PYTEST_ARGS)

test-rest: venv
	$(SUITE) rest -- $(PYTEST_ARGS)

test-all: venv
	$(SUITE) all -- $(PYTEST_ARGS)

test-kernel: venv
	bash scripts/kernel-vm.sh $(KERNEL_TEST_ARGS)

bench: venv
	$(PY) bench/perf_verbs.py

# FIDELITY_ARGS=--quick: the reduced matrix CI runs (under a minute)
fidelity: venv
	$(PY) bench/fidelity.py $(FIDELITY_ARGS)

image: venv
	PYTHON=$(PY) bash images/worker/build.sh $(IMAGE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
