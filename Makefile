# The quickstart's commands. `make train` and `make test` create .venv on first use; each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
RECIPE ?= recipes/fsdp.toml
STEPS ?= 300
RUN ?= runs/quickstart
# The quickstart trains byte-level on the text in data/ (Alice's Adventures in Wonderland; data/README.md says where it
# comes from): its tokens are UTF-8 bytes, so `shardkit generate` needs no tokenizer.
TEXT ?= data/alice.txt
QUICKSTART = --devices 8 --out $(RUN) --steps $(STEPS) --set data.source=text --set data.path=$(TEXT) \
	--set train.seq_len=128

.PHONY: train test test-fast golden docs clean

# What training needs: shardkit and CPU JAX (about 1 GB), no CUDA plugin and no test tools.
$(VENV)/.train: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

# Everything the suite needs (about 6 GB): the test extra, which brings the jax[cuda12] plugin, and the docs tools. It
# upgrades a .venv that `make train` made.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	$(CUDNN_LOADS) || $(BIN)/pip install --quiet --force-reinstall --no-deps nvidia-cudnn-cu12
	touch $(VENV)/.train $@

# The test extra brings the jax[cuda12] plugin on Linux x86_64, so the tests of the deviceless GPU path (cuDNN
# attention, fit, overlap, suggest compiles for --target) run there; elsewhere they skip with the reason printed.
# Some nvidia-cudnn-cu12 wheels install without libcudnn.so.9 ("cuDNN not found"): reinstalling the wheel fixes it.
CUDNN_LOADS = $(BIN)/python -c "import sys; from shardkit.analysis.predicted.targets import cuda_plugin_available; \
	from shardkit.attention.kernel import cudnn_version; sys.exit(0 if not cuda_plugin_available() or cudnn_version() else 1)"

# Trains to STEPS; run again with a larger STEPS to continue from the last checkpoint (`make train STEPS=600`).
train: $(VENV)/.train
	$(BIN)/shardkit train $(RECIPE) $(QUICKSTART)
	@echo "$(RUN) is trained to step $(STEPS). Try: $(BIN)/shardkit generate $(RUN) --prompt 'The '"
	@echo "Continue with: make train STEPS=$$(( $(STEPS) * 2 ))"

# The browser the plan-page test drives through Playwright: Debian's package (Playwright's own download is not needed),
# installed once when missing (these machines run as root).
CHROMIUM = /usr/bin/chromium
$(CHROMIUM):
	apt-get update
	apt-get install -y chromium

# Everything: unit tests and the slow end-to-end runs and equivalence sweeps (`@pytest.mark.slow`). Two pytest-xdist
# workers, one test file each at a time (module-scoped compiles stay shared), in tests/conftest.py's order, heaviest
# first (--no-loadscope-reorder: xdist would order the files by their number of tests). ruff (pyproject.toml's
# settings) first.
# SHARDKIT_REQUIRE_BROWSER=1: the browser test fails rather than skips if Chromium is missing.
TEST_WORKERS ?= 2
test: $(VENV)/.installed $(CHROMIUM)
	$(BIN)/ruff check .
	SHARDKIT_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The unit tests only, a few minutes: what to run while editing.
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow" tests

# Rewrite tests/golden/*.json after an intended change of sharding rules (review the diff before committing).
golden: $(VENV)/.installed
	SHARDKIT_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/test_golden.py

# The docs site at http://127.0.0.1:8000, rebuilt on each edit (mkdocs comes with the test extra).
docs: $(VENV)/.installed
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) runs
