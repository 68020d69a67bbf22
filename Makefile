# Two entry points for a fresh machine: `make run` and `make test`.
# Both create .venv when it is missing and install the project with its test extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= config/stratamq.yaml

.PHONY: install kube-bin run test test-unit test-integration test-cluster test-spark \
  test-kube test-realnode fuzz lint bench typecheck-tree clean kind-e2e crds

install: $(STAMP)

# Real peers the tests and benchmarks run: Prometheus (scrapes /metrics in a test),
# Mosquitto and its C clients (benchmark peer and load generator); libfaketime (a site
# with its clock off, in the clock-skew test) and a C compiler (the power-loss shim of
# the trimming test); for the real-node tests (tests/realnode), containerd, runc, the
# CNI plugins and iptables the kubelets run with, debootstrap and Docker to build the
# images without a registry (images/build-local.sh). Debian packages.
SYSTEM_COMMANDS := prometheus mosquitto mosquitto_pub mosquitto_sub faketime cc \
  containerd runc iptables debootstrap dockerd ip ss
SYSTEM_PACKAGES := prometheus mosquitto mosquitto-clients faketime gcc containerd runc \
  containernetworking-plugins iptables debootstrap docker.io iproute2
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The Python side alone (all the unit tier needs).
PYTHON_STAMP := $(VENV)/.installed-python

$(PYTHON_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,operator,spark]'
	touch $(PYTHON_STAMP)

$(STAMP): $(PYTHON_STAMP)
	@for command in $(SYSTEM_COMMANDS); do \
	  command -v $$command >/dev/null || PATH="$$PATH:/usr/sbin" command -v $$command >/dev/null \
	    || missing=1; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing $(SYSTEM_PACKAGES) from Debian"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	    $(SYSTEM_PACKAGES) >/dev/null; \
	fi
	touch $(STAMP)

# The Kubernetes test binaries (etcd, kube-apiserver, kube-controller-manager, kubectl,
# kubelet and kube-scheduler (the real-node tests),
# helm), built from source with the Go toolchain through the Go module proxy, at the
# versions pinned in tools/kube/*/go.mod; a group already built at its pin is skipped.
# Go is only for this test infrastructure. The first build takes a while (see README).
KUBE_BIN := .cache/bin

kube-bin:
	tools/kube/build.sh $(KUBE_BIN)

run: $(STAMP)
	$(BIN)/stratamq broker --config $(CONFIG)

test: $(STAMP) kube-bin
	$(BIN)/python -m pytest

# The suite in tiers, each what it needs and no more (`make test` runs them all, as CI
# does; pyproject.toml's markers say what each holds). test-unit needs Python only.
test-unit: $(PYTHON_STAMP)
	$(BIN)/python -m pytest tests/unit

test-integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration -m "not cluster"

test-cluster: $(STAMP)
	$(BIN)/python -m pytest tests/integration -m cluster

test-spark: $(STAMP)
	$(BIN)/python -m pytest tests/spark

test-kube: $(STAMP) kube-bin
	$(BIN)/python -m pytest tests/kube

test-realnode: $(STAMP) kube-bin
	$(BIN)/python -m pytest tests/realnode

# The broker fuzz test (tests/integration/test_broker_fuzz.py) at length: the suite runs
# a fixed set of cases; this runs FUZZ_EXAMPLES per test from a random FUZZ_SEED (set
# it to run a failure again: make fuzz FUZZ_SEED=...). No per-test time limit.
FUZZ_EXAMPLES ?= 10000
ifndef FUZZ_SEED
FUZZ_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif

fuzz: $(STAMP)
	@echo "fuzz: FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SEED=$(FUZZ_SEED)"
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SEED=$(FUZZ_SEED) $(BIN)/python -m pytest \
	  tests/integration/test_broker_fuzz.py --timeout=0 -p no:cacheprovider \
	  --hypothesis-show-statistics

# The operator's replication scenario on a kind cluster (needs Docker, kind, kubectl,
# helm; cannot run on the machines this project is built on): tools/kind/e2e.sh.
kind-e2e:
	tools/kind/e2e.sh

# The DurableStorage CRD's sections that mirror the broker's config, written afresh from
# its model (broker/config.py) into crds/ and the chart's copy (operator/crd_schema.py);
# tests/unit/test_crd_schema.py fails until this is run after a change to the model.
crds: $(PYTHON_STAMP)
	$(BIN)/python -m stratamq.operator.crd_schema

# mypy does not run import hooks, so it cannot see the editable install's
# `stratamq.broker -> broker/` mapping; a tree of symlinks gives it the same view.
typecheck-tree:
	mkdir -p .typecheck/stratamq
	ln -sfn ../../broker .typecheck/stratamq/broker
	ln -sfn ../../operator .typecheck/stratamq/operator
	ln -sfn ../../spark .typecheck/stratamq/spark

lint: $(STAMP) typecheck-tree
	$(BIN)/ruff check broker operator spark tests bench harness
	cd .typecheck && ../$(BIN)/mypy --config-file ../pyproject.toml -p stratamq.broker \
	  -p stratamq.operator -p stratamq.spark
	MYPYPATH=.typecheck $(BIN)/mypy tests bench harness

# The benchmarks' peers: Mosquitto (Debian, installed with the stamp above) and
# amqtt (PyPI, the `bench` extra).
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,spark,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python bench/ds_bench.py
	$(BIN)/python bench/broker_bench.py
	$(BIN)/python bench/cluster_bench.py
	$(BIN)/python bench/scale_bench.py

# Keeps .cache/bin: rebuilding the Kubernetes binaries takes long (`rm -rf .cache` does it).
clean:
	rm -rf $(VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache
