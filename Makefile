# Two commands set everything up on a fresh machine; the first use of either creates .venv
# and installs jaxkv there (editable, with its test, dev and bench extras):
#   make demo   runs the main job
#   make test   runs the tests
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,dev,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/serve_shared_prefix.py

# Two worker processes, each taking whole test files (a file's compiled programs stay
# in one process); TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
