# Two commands do all set-up on a fresh machine:  `make run` (the main job) and `make test` (the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
# Two xdist workers: the tests that start processes run one after another on one, the unit tests on the other
# (tests/conftest.py's scheduler).
PYTEST_ARGS ?= -m "not slow" -n 2

.PHONY: setup system-deps run generate test test-all mutation bench clean

setup: $(VENV)/.installed

# torch goes first: the CPU build is installed from its pinned version before anything that depends on it.
$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps nixl-cu12==1.5.1  # its deps would bring another torch; numpy comes next
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m decode_worker.cli fetch-model
	touch $@

# A local PD deployment (sglang-router + prefill + decode) on loopback; it prints the curl to try.
run: setup
	$(VENV)/bin/decode-worker up

generate: setup
	$(VENV)/bin/decode-worker generate --chat "What is the capital of France? Answer in one sentence."

# Debian packages the tests need: redis-server for the L3 storage tests (they start their own on a free port),
# promtool (package prometheus) to check the alert rules and the metrics the worker renders, ip and tc (iproute2)
# for `decode-worker bench --link`'s shaped loopback.
system-deps:
	command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)
	command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)
	command -v tc >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2)

test: setup system-deps
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

# Everything, slow suites included; the lm-eval test needs the eval extra, installed here only.
test-all: setup
	$(PY) -m pip install --quiet -e '.[eval]'
	$(MAKE) test PYTEST_ARGS="-n 2"

# Mutation testing of the cache modules ([tool.mutmut] in pyproject.toml); lists the mutants that survived.
mutation: setup
	$(VENV)/bin/mutmut run --max-children 2; $(VENV)/bin/mutmut results

bench: setup
	$(PY) benchmarks/bench_decode.py --out benchmarks/results/bench_decode.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis mutants
