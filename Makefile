# alfrl: make setup | make test | make train RECIPE=... | make eval CKPT=... | make bench | make data
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
ALFRL := $(VENV)/bin/alfrl
RECIPE ?= recipes/tiny.yaml
DATA_DIR ?= $(or $(ALFWORLD_DATA),$(HOME)/.cache/alfworld)
ARCHIVE ?= $(ALFWORLD_ARCHIVE)
TINY_MODEL ?= .cache/tiny-model
TORCH_CPU ?= torch==2.13.0
SPLIT ?= all
# `make eval` uses recipes/eval.yaml (the reference protocol) unless RECIPE is given
EVAL_RECIPE := $(if $(filter command line environment,$(origin RECIPE)),$(RECIPE),recipes/eval.yaml)
# one file per checkpoint of CKPT (several, space-separated: one engine start evaluates them all), or one for the base model
OUT ?= $(if $(CKPT),$(foreach c,$(CKPT),runs/eval/$(notdir $(basename $(EVAL_RECIPE)))-$(subst /,_,$(c)).jsonl),runs/eval/$(notdir $(basename $(EVAL_RECIPE)))-base.jsonl)
export ALFWORLD_DATA := $(abspath $(DATA_DIR))

.PHONY: setup test train eval bench data tiny-model clean

setup: $(VENV)/.installed

# On a machine without CUDA, install the CPU torch first so no multi-GB CUDA build is pulled in.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -m pip install -q "$(TORCH_CPU)"; fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The games: unpack ARCHIVE (json_2.1.1.tar.xz) if given, else run alfworld-download.
data: setup
	@if [ -d "$(DATA_DIR)/json_2.1.1" ]; then echo "ALFWorld games already in $(DATA_DIR)"; \
	elif [ -n "$(ARCHIVE)" ]; then $(ALFRL) data prepare --data-dir "$(DATA_DIR)" --archive "$(ARCHIVE)"; \
	else $(ALFRL) data prepare --data-dir "$(DATA_DIR)" --download; fi

tiny-model: setup $(TINY_MODEL)/config.json

# rebuilt when the code or the corpus that make it change
$(TINY_MODEL)/config.json: alfrl/tiny.py alfrl/assets/alfworld_corpus.txt
	rm -rf $(TINY_MODEL) && $(ALFRL) tiny-model $(TINY_MODEL)

# TEST_WORKERS test processes at once (pytest-xdist; 0: all in this one), each torch on one thread: two processes whose torch
# each took every core ran two tiny fits in 39.7 s, with one thread each in 27.3 s (one fit alone: 23.6 / 23.0 s; 2 cores)
TEST_WORKERS ?= 2
test: setup data tiny-model
	OMP_NUM_THREADS=1 ALFRL_TINY_MODEL=$(abspath $(TINY_MODEL)) $(PY) -m pytest -q -rs -n $(TEST_WORKERS) $(PYTEST_ARGS)

train: setup data tiny-model
	$(ALFRL) fit --config $(RECIPE) $(ARGS)

# make eval [RECIPE=...] [CKPT="runs/x/checkpoints/last [more ...]"] [SPLIT=all] [LIMIT=N] [OUT="file.jsonl [one per CKPT]"] [OVERWRITE=1]
eval: setup data tiny-model
	$(ALFRL) eval --config $(EVAL_RECIPE) $(if $(CKPT),--adapter $(CKPT)) --split $(SPLIT) \
		$(if $(LIMIT),--limit-per-split $(LIMIT)) --out $(OUT) $(if $(OVERWRITE),--overwrite) $(ARGS)

bench: setup data
	$(PY) bench/env_throughput.py --out bench/out/env_throughput.json
	$(PY) bench/env_throughput.py --compare-reset --workers 2 --rounds 3 --out bench/out/env_reset.json
	$(PY) bench/env_throughput.py --compare-step --workers 2 --rounds 3 --out bench/out/env_step.json

clean:
	rm -rf runs lightning_logs .pytest_cache
