# Prism — two commands on a fresh machine: `make serve` and `make test`.
# Each target (re)creates the virtual environment only when pyproject.toml changed since the last install.

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.prism-installed
TORCH    := torch==2.13.0
# The CPU torch wheel lies on local disk on these machines; elsewhere pip takes it from the index.
WHEELS   := $(wildcard /opt/wheels)
PIP      := $(PY) -m pip install --disable-pip-version-check --no-cache-dir -q $(if $(WHEELS),--find-links $(WHEELS))
MODEL    ?= prism-tiny-llava
CONFIG   ?= ray_configs/local_cpu.yaml
SERVE_FLAGS ?=

.PHONY: venv serve demo test lint format bench chaos batch proto dashboards clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing $(TORCH) (CPU) first, then the project"
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[dev]"
	@touch $(STAMP)

serve: venv
	$(PY) -m services.cli serve --config $(CONFIG) $(SERVE_FLAGS)

demo: venv
	$(PY) -m services.cli demo --model $(MODEL)

test: venv
	$(PY) -m pytest -q --durations=25

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Benchmarks (not tests): ratios measured side by side in one run, written to loadtest/results/.
# make bench BENCH_FLAGS=--quick: every figure once on short loads (minutes), to loadtest/results/quick/.
BENCH_FLAGS ?=
bench: venv
	$(PY) -m loadtest.bench --model prism-small-llava $(BENCH_FLAGS)

# Offline video batch on a local Ray (or RAY_ADDRESS): make batch INPUT=manifest.parquet OUTPUT=out/ [CONFIG=x.yaml]
# CONFIG is passed only when given (serve's default config is not a batch config: the job defaults to a video model).
# Steady load on 2 replicas per stage while one replica of each stage is SIGKILLed; prints the outcomes (not in `make
# test`: minutes, and it kills processes). CHAOS_FLAGS: --clients N, --gap S, --model NAME.
chaos: venv
	$(PY) -m loadtest.chaos $(CHAOS_FLAGS)

batch: venv
	@test -n "$(INPUT)" -a -n "$(OUTPUT)" || (echo "usage: make batch INPUT=<manifest> OUTPUT=<dir> [CONFIG=<yaml>]"; exit 2)
	$(PY) -m services.batch --input $(INPUT) --output $(OUTPUT) $(if $(filter-out file,$(origin CONFIG)),--config $(CONFIG))

# Regenerate the gRPC stubs (committed) after editing services/proto/prism.proto.
proto: venv
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. services/proto/prism.proto

# Regenerate the Grafana dashboards (committed, provisioned by the Helm chart) from common/obs/dashboards.py.
dashboards: venv
	$(PY) -m common.obs.dashboards

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
