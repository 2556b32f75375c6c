# duplexpipe: `make demo`, `make test`, `make bench` (and the GPU check where CUDA is), `make docs`. Each creates .venv when it is missing.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.duplexpipe-installed

.PHONY: demo test bench docs lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[viz,dev,hf,docs,float8,data,wandb]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope

bench: $(STAMP)
	$(BIN)/python -m benchmarks
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(BIN)/python -m benchmarks.gpu_check; else echo "benchmarks.gpu_check: no CUDA GPU, skipped"; fi

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check duplexpipe tests examples benchmarks
	$(BIN)/mypy duplexpipe benchmarks

clean:
	rm -rf $(VENV) demo-output bench-output site
