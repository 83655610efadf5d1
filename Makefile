# Two commands do all set-up on a fresh machine:  `make run` (the main job) and `make test` (the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
# Two xdist workers: the tests that start processes run one after another on one, the unit tests on the other
# (tests/conftest.py's scheduler).
PYTEST_ARGS ?= -m "not slow" -n 2

.PHONY: setup system-deps run generate test test-all test-latest test-interop lock mutation bench clean

setup: $(VENV)/.installed

# The venv holds exactly the lock (locks/main.txt: every dependency with its hashes, test and bench extras
# included) plus torch at its pin and the project itself; a changed lock makes it anew. Nothing resolves here:
# each install takes no dependencies of its own, and `pip check` proves the set complete. torch goes first, at its
# pin, from its CPU build (on this kind of machine pip takes a local file; the README says how elsewhere).
$(VENV)/.installed: pyproject.toml locks/main.txt
	rm -rf $(VENV)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --no-deps torch==2.13.0
	$(PY) -m pip install --quiet --no-deps --require-hashes -r locks/main.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	$(PY) -m decode_worker.cli fetch-model
	touch $@

# Regenerates the locks from pyproject.toml's ranges with uv (pinned below; it resolves in seconds and writes
# hashes): main.txt for `make setup`, runtime.txt (no extras) for the images, eval.txt for `make test-all`, the
# last two held to main.txt's versions. It keeps the locked versions that the ranges still allow; `make lock
# UPGRADE=1` moves every package to its newest release. locks/overrides.txt keeps torch at its pin and its CUDA
# runtime out.
UV_VERSION := 0.13.9
UV := .tools/bin/uv
LOCK := $(UV) pip compile --quiet --custom-compile-command "make lock" --universal --python-version 3.11 --generate-hashes --no-emit-package torch \
	--override locks/overrides.txt pyproject.toml locks/build.in

$(UV):
	python3 -m venv .tools
	.tools/bin/pip install --quiet uv==$(UV_VERSION)

lock: $(UV)
	$(LOCK) $(if $(UPGRADE),--upgrade) --extra test --extra bench -o locks/main.txt
	$(LOCK) -c locks/main.txt -o locks/runtime.txt
	$(LOCK) -c locks/main.txt --extra test --extra bench --extra eval -o locks/eval.txt
	$(UV) pip compile --quiet --custom-compile-command "make lock" --no-deps --python-version 3.11 \
		--python-platform x86_64-manylinux_2_34 --generate-hashes locks/interop.in -o locks/interop.txt
	$(UV) pip compile --quiet --custom-compile-command "make lock" --python-version 3.11 \
		--python-platform x86_64-manylinux_2_34 --generate-hashes locks/dynamo.in -o locks/dynamo.txt
	@! grep -E '^(nvidia|cuda)-' locks/*.txt | grep -v "sys_platform == 'never'" \
		|| { echo "a CUDA package entered the lock: add it to locks/overrides.txt"; exit 1; }

# The newest releases pyproject.toml's ranges allow, in a throwaway venv: the unit suite and one end-to-end test,
# then the packages that differ from the lock. Not part of `make test`; see the README on moving the lock forward.
test-latest: system-deps
	.ci/test-latest

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

# NVIDIA Dynamo's KV indexer, a real consumer of the KV events (tests/integration/test_dynamo_indexer.py), in a
# venv of its own (locks/dynamo.txt): ai-dynamo-runtime pins a pydantic older than the project's.
DYNAMO_VENV ?= .dynamo-venv
$(DYNAMO_VENV)/.installed: locks/dynamo.txt
	rm -rf $(DYNAMO_VENV)
	python3 -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/python -m pip install --quiet --no-deps --require-hashes -r locks/dynamo.txt
	touch $@

# Everything, slow suites included; the lm-eval test needs the eval extra, installed here only, and the Dynamo
# indexer test its venv.
test-all: setup $(DYNAMO_VENV)/.installed
	$(PY) -m pip install --quiet --no-deps --require-hashes -r locks/eval.txt
	$(MAKE) test PYTEST_ARGS="-n 2"

# Our side of SGLang's PD protocol against SGLang 0.5.18's own code, in a venv of its own (locks/interop.txt):
# sglang's transfer modules without its full dependency set, torchvision a stub (tests/interop/stubs).
INTEROP_VENV ?= .interop-venv
$(INTEROP_VENV)/.installed: locks/interop.txt
	rm -rf $(INTEROP_VENV)
	python3 -m venv $(INTEROP_VENV)
	$(INTEROP_VENV)/bin/python -m pip install --quiet --no-deps torch==2.13.0
	$(INTEROP_VENV)/bin/python -m pip install --quiet --no-deps --require-hashes -r locks/interop.txt
	touch $@

test-interop: setup $(INTEROP_VENV)/.installed
	DECODE_WORKER_INTEROP=1 DECODE_WORKER_PYTHON=$(abspath $(PY)) PYTHONPATH=.:kernels:tests/interop/stubs \
		$(INTEROP_VENV)/bin/python -m pytest \
		--confcutdir=tests/interop -p no:cacheprovider tests/interop

# Mutation testing of the cache modules ([tool.mutmut] in pyproject.toml); lists the mutants that survived.
mutation: setup
	$(VENV)/bin/mutmut run --max-children 2; $(VENV)/bin/mutmut results

bench: setup
	$(PY) benchmarks/bench_decode.py --out benchmarks/results/bench_decode.json

clean:
	rm -rf $(VENV) .tools .pytest_cache .hypothesis mutants
