# Fresh-machine entry points: `make train` and `make test` need only python3.
# Prefer Python 3.12 (jax 0.11+); fall back to python3 (jax 0.10.2 on 3.11).
PYTHON ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 python3; do \
	$$p -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/quickstart.yaml
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: train test venv clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

train: venv
	$(BIN)/jaxpar train $(CONFIG)
ifeq ($(CONFIG),configs/quickstart.yaml)
	@echo "--- what the model learned: jaxpar generate runs/quickstart --prompt 'def ' ---"
	@$(BIN)/jaxpar generate runs/quickstart --prompt 'def ' --max-tokens 120 --temperature 0.6
endif

# 3 workers on 2 cores: the multi-process tests wait on their children (start-up, sleeps between
# steps, cluster daemons) for about a quarter of the run; a third worker fills that time
TEST_WORKERS ?= 3

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

clean:
	rm -rf $(VENV) runs .pytest_cache
