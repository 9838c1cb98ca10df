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

# Debian packages the integration tests run for real (prometheus/promtool, systemd-analyze)
SYSDEPS := $(VENV)/.r9k-sysdeps
$(SYSDEPS): scripts/ci-system-deps.sh | $(STAMP)
	bash scripts/ci-system-deps.sh
	touch $(SYSDEPS)

test: $(STAMP) $(SYSDEPS)
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
