# The set-up a new user types: `make bench` (install, then the main job) and `make test` (install, then
# the tests). Both install once into $(VENV) with buildtools/install.sh, and again when pyproject.toml
# or the install script change; a change to the compiled core (csrc/) rebuilds it.
VENV ?= .venv
BENCH_ARGS ?=
PY := $(VENV)/bin/python

.PHONY: install bench test

install: $(VENV)/.built

$(VENV)/.ready: pyproject.toml buildtools/install.sh
	bash buildtools/install.sh $(VENV)

$(VENV)/.built: $(VENV)/.ready $(wildcard csrc/*.cpp csrc/*.h) CMakeLists.txt setup.py
	$(PY) -m pip install -q -e . --no-deps
	touch $@

bench: install
	$(PY) -m colo.bench --quick $(BENCH_ARGS)

test: install
	$(PY) -m pytest -n 2
