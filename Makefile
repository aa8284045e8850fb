# recpipe: every set-up step lives here. A fresh machine needs only python3.11.
#   make venv   create .venv, install the pinned stack, build + install recpipe
#   make lint   ruff check + ruff format --check (ruff.toml), scripts/code_shape.py --check,
#               mypy over pipeline/ planner/ recipes/ (mypy.ini)
#   make test   venv + pytest (CI: .ci/run runs lint, then test)
#   make bench  venv + every scripts/bench_*.py
#   make run    venv + the default recipe through torchx (2 local CPU processes)
#   make dev    build the extension in place and lay out build/dev for PYTHONPATH
#   make test-portable  tests/csrc against a RECPIPE_PORTABLE=1 CPU build in build/portable
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.stack-installed
SRCS   := $(shell find csrc pipeline planner recipes -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.yaml' \) 2>/dev/null) setup.py
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: venv lint test test-portable bench run dev clean

$(STAMP): requirements.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	touch $@

$(VENV)/.recpipe-installed: $(STAMP) $(SRCS)
	$(PIP) install -q --no-build-isolation --no-deps .
	touch $@

venv: $(VENV)/.recpipe-installed

LINTED := pipeline planner recipes scripts tests examples setup.py

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(PY) scripts/code_shape.py --check
	mkdir -p build/typecheck/recpipe
	for d in pipeline planner recipes; do ln -sfn ../../../$$d build/typecheck/recpipe/$$d; done
	cd build/typecheck && ../../$(VENV)/bin/mypy --config-file ../../mypy.ini -p recpipe.pipeline -p recpipe.planner -p recpipe.recipes

test: venv
	cd tests && ../$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: venv
	@for b in scripts/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

run: venv
	$(PY) -m recpipe.recipes.launch $(ARGS)

# Development overlay: `PYTHONPATH=build/dev` imports the source folders live
# (symlinked) with a CPU-only extension. Tests in CI use the installed package.
dev: $(STAMP)
	RECPIPE_CUDA=$${RECPIPE_CUDA:-0} $(PY) setup.py -q build_ext -b build/dev
	mkdir -p build/dev/recpipe
	for d in pipeline planner recipes; do ln -sfn ../../../$$d build/dev/recpipe/$$d; done

# Portable build: the extension without the x86 dispatch (RECPIPE_PORTABLE=1, the
# paths aarch64 compiles) and without CUDA, laid out like build/dev in
# build/portable with its own temp folder; the op tests run against it and
# tests/csrc/test_cpu_dispatch.py checks that it is the portable build.
PORTABLE := build/portable
test-portable: $(STAMP)
	RECPIPE_PORTABLE=1 RECPIPE_CUDA=0 $(PY) setup.py -q build_ext -b $(PORTABLE) -t build/temp.portable
	mkdir -p $(PORTABLE)/recpipe
	for d in pipeline planner recipes; do ln -sfn ../../../$$d $(PORTABLE)/recpipe/$$d; done
	cd tests && RECPIPE_PORTABLE=1 PYTHONPATH=../$(PORTABLE) ../$(PY) -m pytest -q -p no:cacheprovider csrc $(PYTEST_ARGS)

clean:
	rm -rf build dist *.egg-info $(VENV)/.recpipe-installed
