# The README's two commands are `make demo` and `make test`; both create the environment first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.efftx-installed

# The venv's bin first: DeepSpeed builds its CPU ops with the venv's ninja (another one forces rebuilds),
# and `ray`, `python`, `mlflow` in recipes below are the venv's.
export PATH := $(BIN):$(PATH)

.PHONY: setup browser demo test test-fast bench gpu-check gpu-pair serve redeploy cluster-up cluster-down submit-example clean-runs

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	@echo "installing efftx and its pinned dependencies into $(VENV) (about 4 minutes the first time)..."
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	@# DeepSpeed's CPU ops (shared-memory collective, CPU Adam for ZeRO-Offload), compiled once into the venv
	$(BIN)/python -m efftx.train.ops
	@# NSA's C++ CPU kernels (efftx/kernels/nsa_selected_cpu.cpp), compiled once for this CPU
	$(BIN)/python -m efftx.kernels.nsa_selected_cpu
	@# the few-row CPU linear kernel of decoding steps (efftx/kernels/linear_cpu.cpp)
	$(BIN)/python -m efftx.kernels.linear_cpu
	@# RMSNorm without autograd on a CPU: decoding's norms (efftx/kernels/rms_norm_cpu.cpp)
	$(BIN)/python -m efftx.kernels.rms_norm_cpu
	@# full attention's few-token cached passes on a CPU (efftx/kernels/decode_attention_cpu.cpp)
	$(BIN)/python -m efftx.kernels.decode_attention_cpu
	@# sampling's counter-based noise, every row of a draw in one call (efftx/kernels/row_noise_cpu.cpp)
	$(BIN)/python -m efftx.kernels.row_noise_cpu
	@# sampling's distributions and races, one call per pass (efftx/kernels/sampling_cpu.cpp)
	$(BIN)/python -m efftx.kernels.sampling_cpu
	touch $(STAMP)

setup: $(STAMP)

# Debian's chromium for the browser tests (tests/test_playground.py), installed when it is missing and apt-get
# can run (as root, or with passwordless sudo). When it cannot be installed this fails and says why: the browser
# tests never skip silently. EFFTX_CHROMIUM=/path/to/chromium uses another Chromium build;
# EFFTX_SKIP_BROWSER=1 skips the browser tests on purpose (they then report as skipped, naming the variable).
browser:
	@if [ "$$EFFTX_SKIP_BROWSER" = 1 ] || [ -n "$$EFFTX_CHROMIUM" ] || command -v chromium >/dev/null 2>&1 \
	    || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "error: no chromium and no apt-get to install it: install Chromium and set EFFTX_CHROMIUM=/path/to/it," \
	       "or set EFFTX_SKIP_BROWSER=1 to skip the browser tests" >&2; exit 1; \
	else \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
	  if [ "$$SUDO" = none ]; then \
	    echo "error: chromium is missing and apt-get needs root: run 'sudo apt-get install -y chromium'," \
	         "or set EFFTX_SKIP_BROWSER=1 to skip the browser tests" >&2; exit 1; \
	  fi; \
	  echo "installing Debian's chromium for the browser tests..."; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
	  || { $$SUDO apt-get update -q >/dev/null && \
	       $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
	  || { echo "error: could not install Debian's chromium (see apt-get above), so the browser tests cannot run;" \
	            "set EFFTX_SKIP_BROWSER=1 to skip them on purpose" >&2; exit 1; }; \
	fi

demo: setup                       ## the main job on the embedded default (local Ray, sqlite MLflow, bundled corpus)
	$(BIN)/python jobs/train_sinkhorn.py $(ARGS)

# Two test processes (pytest-xdist), each with its own Ray cluster and efftx home; a test file stays in one process
# (its module fixtures are made once). Most of a test's time is waiting on Ray, Serve or a subprocess, so two
# processes overlap it even on 2 cores. TEST_JOBS=0 runs everything in this process (what `pytest` alone does).
TEST_JOBS ?= 2
test: setup browser               ## the whole test suite, slow end-to-end and browser tests included
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(BIN)/python bench/train_throughput.py

gpu-check: setup                  ## every CUDA path in one command, one table (needs a CUDA GPU; see bench/gpu_check.py)
	$(BIN)/python bench/gpu_check.py $(ARGS)

# A trained small speculative pair (+ a distilled draft) in .efftx/gpu-pair, for the GPU check's speculative section
# on a GPU image with torch alone (bench/gpu_pair.py: two jobs, the small pair and then a distilled draft)
gpu-pair: setup                   ## train the speculative pair the GPU check's speculative section judges
	$(BIN)/python bench/gpu_pair.py $(ARGS)

# The Serve app of serve/text.yaml (or SERVE_CONFIG=...): its models are trained (jobs/train_speculative.py --size
# small, jobs/train_dalle.py --recipe dalle_shapes_small) and promoted to @champion first when the registry has
# none (python -m efftx.serving.ready says which and how long it took), then `serve run` (Ctrl-C stops it).
# SERVE_INGRESS=haproxy: HTTP from HAProxy straight to the replicas instead of Serve's Python proxy
# (efftx.serving.ingress; README, serving benchmarks).
SERVE_CONFIG ?= serve/text.yaml
SERVE_INGRESS ?= proxy
serve: setup                      ## serve/text.yaml's app, training and promoting its models first if missing
	$(BIN)/python -m efftx.serving.ready $(SERVE_CONFIG)
	@echo "serving $(SERVE_CONFIG) (its aliases pinned to versions; after efftx.promote, \`make redeploy\` moves the" \
	      "running app onto the new champions): the playground is http://127.0.0.1:8000/ once the app is up (Ctrl-C stops it)"
	pinned=$$($(BIN)/python -m efftx.serving.deploy --pin-only $(SERVE_CONFIG)) && \
	  $(BIN)/python -m efftx.serving.ingress $(SERVE_INGRESS) -- $(BIN)/serve run "$$pinned"

redeploy: setup                   ## the running app of SERVE_CONFIG onto the versions its aliases name now, no request dropped
	$(BIN)/python -m efftx.serving.deploy $(SERVE_CONFIG) $(ARGS)

cluster-up: setup                 ## a real local Ray cluster running from the venv, token auth on (token made if none)
	$(BIN)/python -m efftx.cluster up --num-cpus 2

cluster-down:
	$(BIN)/python -m efftx.cluster down

submit-example: setup             ## submit the debug job to the cluster started by `make cluster-up`
	$(BIN)/python -m efftx.cluster submit --working-dir . -- python jobs/train_lm.py --recipe lm_debug

# An MLflow tracking server for runs on a cluster (README, "MLflow server"): foreground, Ctrl-C stops it. ARGS for
# its options, e.g. ARGS="--host 0.0.0.0 --artifacts-destination s3://bucket/mlartifacts".
.PHONY: mlflow-server
mlflow-server: setup              ## mlflow server (sqlite + proxied artifacts) on 127.0.0.1:5000; prints the tracking URI
	$(BIN)/python -m efftx.tracking_server $(ARGS)

clean-runs:                       ## forget every local run (checkpoints, exports, MLflow db, corpus cache)
	rm -rf .efftx
