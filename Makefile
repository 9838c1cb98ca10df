# Two entry points: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.r9k-installed

.PHONY: demo test install clean-venv

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV) $(PYTHON)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/r9k demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
