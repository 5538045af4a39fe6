# musebench: two commands on a fresh machine: `make install`, then `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The CPU build on machines without a GPU; a machine that already has torch keeps its own.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test test-dsl-compat test-gpu parity lint clean

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_CPU)"
	$(PIP) install -q -e ".[dev]"

test:
	$(PYTHON) -m pytest -n auto -q

# CuTe DSL 4.8.0 with its cu13 libraries, what vLLM 0.33.0 pins (nvidia-cutlass-dsl[cu13]==4.8.0), beside
# the environment's own DSL: installed apart under .cache/ (git-ignored) and put first on the path for
# a subset of the compile tests (every kernel family, both targets; a minute or two on two cores).
# Without a GPU driver the DSL loads its newest library flavor, here cu13, as vLLM's install does.
DSL_COMPAT_VERSION ?= 4.8.0
DSL_COMPAT_DIR ?= .cache/dsl-$(DSL_COMPAT_VERSION)
DSL_COMPAT_PACKAGES := nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
	nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13
# dsl_packages too: the wheel's .pth that adds it is not read from a PYTHONPATH folder
DSL_COMPAT_ENV = PYTHONPATH=$(abspath $(DSL_COMPAT_DIR)):$(abspath $(DSL_COMPAT_DIR))/nvidia_cutlass_dsl/dsl_packages \
	CUTE_DSL_CACHE_DIR=$(abspath $(DSL_COMPAT_DIR))/jit-cache
DSL_COMPAT_TESTS := tests/kernels/test_compile_dumps.py tests/kernels/test_ep_tail_compile.py \
	tests/kernels/test_tp_tail_compile.py tests/kernels/test_routing_compile.py tests/kernels/test_ptx.py \
	tests/kernels/test_attn2_compile.py tests/kernels/test_qkv_front_compile.py tests/kernels/test_oneshot_allreduce_compile.py
DSL_COMPAT_SELECT := test_compile_dumps or test_approximation_kernels or test_without_pdl \
	or (test_publisher_ptx and tp8-bf16-before) or (test_reduce_ptx and -2-pdl) \
	or (test_single_launch_ptx and -2-unicast-pdl) or (test_core_variants and tp4-S8-owner) \
	or (test_stock_decode_paths and tp8-m7-S16-owner-partials-ko1-exact-bf16-before) \
	or (test_score_arithmetic and meta-renorm) \
	or test_compiles_with_ptx_assertions or test_variant_compiles_with_the_contracts_instructions or test_one_shot_ptx

test-dsl-compat: $(DSL_COMPAT_DIR)/.installed
	$(DSL_COMPAT_ENV) $(PYTHON) -c "import importlib.metadata as m, cutlass; \
		v = m.version('nvidia-cutlass-dsl'); assert v == cutlass.__version__ == '$(DSL_COMPAT_VERSION)', (v, cutlass.__file__); \
		print('CuTe DSL', v, 'from', cutlass.__file__)"
	$(DSL_COMPAT_ENV) $(PYTHON) -m pytest -q -p no:xdist $(DSL_COMPAT_TESTS) -k "$(DSL_COMPAT_SELECT)"

$(DSL_COMPAT_DIR)/.installed:
	rm -rf $(DSL_COMPAT_DIR)
	$(PIP) install -q --no-deps --target $(DSL_COMPAT_DIR) $(foreach p,$(DSL_COMPAT_PACKAGES),$(p)==$(DSL_COMPAT_VERSION))
	touch $@

test-gpu:
	$(PYTHON) -m pytest -m gpu -q

parity:
	$(PYTHON) -m musebench parity scenarios/parity.toml --json records/parity-latest.json --junit records/parity-latest.xml

clean:
	rm -rf .pytest_cache build *.egg-info
