# make run: set up .venv and run the main job (+recipe=quickstart); make test: the full suite, on
# every core (pytest-xdist);
# make test-fast: the inner loop, without tests marked slow (pytest -m 'not slow').
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
EXTRAS ?= dev,joblib,slurm,postgres

.PHONY: run test test-fast lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m mlxbun +recipe=quickstart

test: $(STAMP)
	$(PY) -m pytest -n auto --dist loadgroup

test-fast: $(STAMP)
	$(PY) -m pytest -n auto --dist loadgroup -m "not slow"

lint: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/pre-commit run --all-files

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
