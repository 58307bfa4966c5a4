# The two commands of the quickstart. `make train` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
RECIPE ?= recipes/fsdp.toml

.PHONY: train test test-fast golden clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(CUDNN_LOADS) || $(BIN)/pip install --quiet --force-reinstall --no-deps nvidia-cudnn-cu12
	touch $@

# The test extra brings the jax[cuda12] plugin on Linux x86_64, so the tests of the deviceless GPU path (cuDNN
# attention, fit, overlap, suggest compiles for --target) run there; elsewhere they skip with the reason printed.
# Some nvidia-cudnn-cu12 wheels install without libcudnn.so.9 ("cuDNN not found"): reinstalling the wheel fixes it.
CUDNN_LOADS = $(BIN)/python -c "import sys; from shardkit.analysis.predicted.targets import cuda_plugin_available; \
	from shardkit.attention.kernel import cudnn_version; sys.exit(0 if not cuda_plugin_available() or cudnn_version() else 1)"

train: $(VENV)/.installed
	$(BIN)/shardkit train $(RECIPE) --devices 8 --out runs/quickstart

# The browser the plan-page test drives through Playwright: Debian's package (Playwright's own download is not needed),
# installed once when missing (these machines run as root).
CHROMIUM = /usr/bin/chromium
$(CHROMIUM):
	apt-get update
	apt-get install -y chromium

# Everything: unit tests and the slow end-to-end runs and equivalence sweeps (`@pytest.mark.slow`). Two pytest-xdist
# workers, one test file each at a time (module-scoped compiles stay shared). ruff (pyproject.toml's settings) first.
# SHARDKIT_REQUIRE_BROWSER=1: the browser test fails rather than skips if Chromium is missing.
TEST_WORKERS ?= 2
test: $(VENV)/.installed $(CHROMIUM)
	$(BIN)/ruff check .
	SHARDKIT_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The unit tests only, a few minutes: what to run while editing.
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow" tests

# Rewrite tests/golden/*.json after an intended change of sharding rules (review the diff before committing).
golden: $(VENV)/.installed
	SHARDKIT_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/test_golden.py

clean:
	rm -rf $(VENV) runs
