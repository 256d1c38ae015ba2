# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FMNIST_DIR := /usr/share/datasets/fashion-mnist
KJV := $(HOME)/.cache/jaxtrain/kjv/kjv.txt
# Two workers: compiles and subprocess start-ups overlap; worksteal rebalances the tail of long tests
# (17:37 against 20:17 with the default scheduling, one run each here); --durations names the slowest tests.
PYTEST_ARGS ?= -n 2 --dist worksteal --durations=20

.PHONY: setup data kjv gpt-demo onednn jpeg torch-venv demo test cluster test-latest test-gpu-compile gpu-bundle gpu-rehearse gpu-check wheel-check docs clean help

help:
	@echo "make demo   set up, then train the d2l LeNet on Fashion-MNIST on 2 devices (10 epochs)"
	@echo "make test   set up, then run the whole test suite"
	@echo "make cluster  start a one-node SLURM + Open MPI here (root; installs them), run the cluster tests, stop it"
	@echo "make test-latest  the suite again on the newest Python >= 3.12 here with the newest JAX (.venv-latest)"
	@echo "make test-gpu-compile  the gpu_compile tests: steps compiled for 8 H100s on this host (a cached ~5.6 GB venv)"
	@echo "make gpu-bundle  fetch the wheels a GPU machine without a registry lacks (.gpu-bundle, ~16 MiB)"
	@echo "make wheel-check  the wheel as users install it: built, installed alone (core, then [all]) and run outside the checkout"
	@echo "make gpu-rehearse  gpu-check rehearsed here: the GPU image's versions, the bundle alone, the CPU backend"
	@echo "make gpu-check   on a GPU machine: every GPU figure measured, beside the estimate (kept as docs/gpu-runs/DATE-GPU.json, .md)"
	@echo "make docs   set up, then build the documentation site into docs/_build/html (warnings are errors)"
	@echo "make data   install the Debian package dataset-fashion-mnist if it is missing"
	@echo "make kjv    write the King James Bible as text ($(KJV)) from Debian's bible-kjv: the language models' corpus"
	@echo "make gpt-demo  train the mini GPT on it for a few minutes on this CPU, then sample from it"
	@echo "make onednn install g++ (it compiles oneDNN's convolutions for CPUs) if it is missing"
	@echo "make jpeg   install libjpeg-turbo's headers (image folders' JPEG region decoder) if they are missing"
	@echo "make torch-venv  build the PyTorch venv the pretrained-weights tests compare against"
	@echo "make setup  create/update $(VENV) and install jaxtrain with its test extras"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "jaxtrain needs Python >= 3.11; set PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)
	@# compiles oneDNN's convolutions for CPUs where g++ is here; where not it says why and exits 1: set-up goes on
	@$(PY) -m jaxtrain.kernels.onednn || true
	@$(PY) -m jaxtrain.data.jpeg || true

setup: $(STAMP)

data:
	@if [ -d $(FMNIST_DIR) ]; then \
		echo "Fashion-MNIST: $(FMNIST_DIR)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian package dataset-fashion-mnist"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; \
	else \
		echo "Fashion-MNIST not found in $(FMNIST_DIR) and apt-get is not usable as root:"; \
		echo "  TFDS will download it on first use (needs internet), or pass --data-dir DIR with the IDX files."; \
	fi

# The language models' offline corpus (docs/language-models.md): Debian's bible-kjv (its `bible` program and the
# compressed text) printed whole, Genesis 1:1 to Revelation 22:21, once.
kjv:
	@if [ -s $(KJV) ]; then \
		echo "King James Bible: $(KJV)"; exit 0; \
	elif ! command -v bible >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian package bible-kjv"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bible-kjv >/dev/null; \
	fi; \
	if ! command -v bible >/dev/null; then \
		echo "kjv: Debian's bible-kjv is missing and apt-get is not usable as root: install it (apt-get install bible-kjv),"; \
		echo "  or train on any text: --dataset text:PATH"; exit 1; \
	fi; \
	mkdir -p $$(dirname $(KJV)) && bible gen1:1-rev22:21 </dev/null > $(KJV).tmp && [ -s $(KJV).tmp ] && \
		mv $(KJV).tmp $(KJV) && echo "King James Bible: $(KJV) ($$(wc -c < $(KJV)) bytes)"

gpt-demo: setup kjv
	$(PY) -m experiments.gpt --devices 2 --log-every 50

# oneDNN's convolutions for CPUs (jaxtrain.kernels.onednn; conv="auto" uses them where they build): oneDNN comes
# with jaxtrain's cpu-conv extra (pip: onednn-cpu-gomp; make setup installs it); they are compiled on first use with g++. Without g++ the models keep
# XLA's convolutions.
onednn:
	@if command -v g++ >/dev/null; then \
		echo "g++: $$(command -v g++)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian package g++ (to compile oneDNN's convolutions for CPUs)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; \
	else \
		echo "g++ missing and apt-get is not usable as root: jaxtrain keeps XLA's convolutions on CPUs"; \
		echo "  (slower for ResNet-18 and LeNet); install g++ to use oneDNN's."; \
	fi

# Image folders decode a JPEG's crop alone (jaxtrain.data.jpeg), compiled on first use with g++ against
# libjpeg-turbo (Debian: libjpeg-dev). Without it JPEGs are decoded whole by Pillow (slower), saying so.
jpeg:
	@if [ -f /usr/include/jpeglib.h ]; then \
		echo "libjpeg headers: /usr/include/jpeglib.h"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian package libjpeg-dev (for the JPEG region decoder)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjpeg-dev >/dev/null; \
	else \
		echo "libjpeg headers missing and apt-get is not usable as root: image folders' JPEGs are decoded whole"; \
		echo "  by Pillow (slower); install libjpeg-turbo's headers (libjpeg-dev) to decode only each crop."; \
	fi

# The PyTorch side of the pretrained-weights tests (tests/test_pretrained.py): torch, torchvision, timm and
# safetensors in their own venv, outside the checkout (tools/torch-venv; ~5.5 GB, kept for later runs).
torch-venv:
	@bash tools/torch-venv >/dev/null || echo "torch-venv: not built: the pretrained-weights tests skip here (CI fails them)"

demo: onednn jpeg setup data
	$(PY) -m experiments.lenet --devices 2

test: onednn jpeg torch-venv setup data
	$(PY) -m pytest -m "not cluster" $(PYTEST_ARGS)

# The cluster tests (docs/cluster.md): a real SLURM and Open MPI on this host (tools/cluster), one job at a time,
# the daemons stopped after, whatever the tests did.
CLUSTER_PYTEST_ARGS ?= --durations=10
cluster: onednn jpeg setup data
	tools/cluster up || { tools/cluster down; exit 1; }
	status=0; env $$(tools/cluster env) $(PY) -m pytest -m cluster $(CLUSTER_PYTEST_ARGS) tests/test_cluster.py \
		|| status=$$?; tools/cluster down; exit $$status

# The newest-JAX leg (docs/getting-started.md, "Tested versions"): LATEST_PYTEST_ARGS picks the tests; .ci/run gives
# it LATEST_TESTS, the files whose subject is JAX's own behaviour (every strategy, sharding, precision,
# accumulation, K steps a call and the data on the device against the reference; what differs between versions;
# checkpoints, kernels, the loop) and those of the other ranged dependencies (optax, grain, TFDS, qwix, optuna, the
# trackers), not slow: 17 min with a cold compile cache before the second group was added, where the whole suite,
# not slow, took 24 (Intel Xeon with AVX-512, 2 cores, 2026-11-29).
LATEST_TESTS := tests/test_compat.py tests/test_step.py tests/test_sharding.py tests/test_explicit.py \
	tests/test_hybrid.py tests/test_accumulate.py tests/test_precision.py tests/test_remat.py \
	tests/test_pipeline_parallel.py tests/test_steps_per_call.py tests/test_calls.py tests/test_on_device.py \
	tests/test_batch_stats.py tests/test_nnx.py tests/test_random.py tests/test_checkpoint.py tests/test_kernels.py \
	tests/test_kernels_mosaic.py tests/test_onednn.py tests/test_tolerance.py tests/test_resnet.py \
	tests/test_reference.py tests/test_devices.py tests/test_loop.py \
	tests/test_optim.py tests/test_data.py tests/test_datasets.py tests/test_feeding.py tests/test_quantize.py \
	tests/test_sweep.py tests/test_track.py tests/test_gpt.py tests/test_gpt_pipeline.py tests/test_generate.py \
	tests/test_text.py
LATEST_PYTEST_ARGS ?= -n 2 --dist worksteal
test-latest: data
	bash tools/test-latest $(LATEST_PYTEST_ARGS)

# The GPU-compile leg (README "Planning for GPUs"): its venv is cached outside the checkout.
GPU_PYTEST_ARGS ?= -n 2 --dist worksteal --durations=10
test-gpu-compile:
	bash tools/test-gpu-compile $(GPU_PYTEST_ARGS)

# The documentation site: MyST pages + the API from the docstrings; a warning (a broken reference, a public
# name missing from docs/api.md) fails the build.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,docs]'
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	rm -rf docs/_build
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

clean:
	rm -rf $(VENV) .venv-latest runs .pytest_cache build *.egg-info docs/_build .gpu-bundle .gpu-site gpu-check-rehearsal

# The day a GPU is available (docs/gpu.md): the wheels its image lacks, fetched here; the check, run there.
# The wheel and the sdist built, the wheel installed alone into fresh venvs (core, then [all]; in
# ~/.cache/jaxtrain/wheel-check) and used from outside the checkout (tools/wheel-check says what it checks).
wheel-check: data jpeg onednn
	bash tools/wheel-check
gpu-bundle:
	bash tools/gpu-bundle
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
# Here: an image-like venv, the bundle installed with --no-index, gpu_check --dry-run (CI runs it).
gpu-rehearse:
	bash tools/gpu-rehearse
gpu-check:
	@test -d .gpu-bundle || { echo "gpu-check: no .gpu-bundle here: run make gpu-bundle on a host with a package registry and bring it along"; exit 2; }
	$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target .gpu-site .gpu-bundle/*.whl
	PYTHONPATH=$(CURDIR)/.gpu-site:$(CURDIR) $(GPU_PYTHON) -m experiments.gpu_check --keep docs/gpu-runs $(GPU_CHECK_ARGS)
