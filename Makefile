# The two commands: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch==2.13.0 is pinned: on the project's CPU machines pip takes a CPU build from
# local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# Triton for its interpreter (TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors): the
# second pytest run of `make test` checks the decode pair kernel's arithmetic order, launch rules
# and bad arguments there, that the paged-KV value checks' kernels decide as the torch masks do, and
# the other kernels (norm/rope, paged KV, linear, column sums, the merge) on what the interpreter
# decides exactly (tests/test_triton_interpret.py), over 2 workers (pytest-xdist; numpy-bound). 3.9: 3.6's interpreter (the Triton the H200 compiles with) fails on
# these kernels (a scalar conversion TypeError).
TRITON ?= triton==3.9.0
# The Triton the GPU compiles with (the H200's torch 2.11+cu130 brings 3.6.0), beside the venv's:
# the third pytest run of `make test` builds every decode kernel variant for sm90 with it
# (tests/test_sm90_compile.py), so a kernel that 3.6 no longer compiles fails on CPU (session 24:
# 'rows' and 'tile' had stopped compiling on the GPU while 3.9 still built them).
TRITON_GPU ?= triton==3.6.0
TRITON_GPU_DIR := .triton-gpu
# FA4 and the CUTLASS DSL (CPU wheels: the DSL compiles for sm_90a without a GPU under FA4's fake
# mode), beside the venv: the fourth pytest run of `make test` builds the FA4 chunk walk
# (rlk_ops/kernels/fa4/walk_sm90.py) for sm_90a (tests/test_fa4_walk_compile.py). The versions
# are the GPU machine's (../shared/gpu); the DSL's CUDA 12 libraries here, 13 there.
CUTE_GPU ?= nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
	nvidia-cutlass-dsl-libs-cu12==4.8.1 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 flash-attn-4==4.0.0b36 \
	quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2
CUTE_GPU_DIR := .cute-gpu
DEVICE ?= cpu
DEMO_ARGS ?=
PYTEST_ARGS ?=
# Disk: `make test` puts about 3 GB beside the clone (.venv 2.2 GB with transformers, .triton-gpu 0.6 GB, .cute-gpu
# 0.3 GB). --no-cache-dir keeps pip from writing a second copy of every wheel into its cache (a CI
# run failed with 'No space left on device' while installing .cute-gpu).

.PHONY: setup demo test bench inspect clean

$(VENV)/.stamp: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-cache-dir "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q --no-cache-dir -e ".[test]"
	touch $@

$(CUTE_GPU_DIR)/.stamp: Makefile | $(VENV)/.stamp
	$(PY) -m pip install -q --no-cache-dir --no-deps --upgrade --target $(CUTE_GPU_DIR) $(CUTE_GPU)
	touch $@

$(TRITON_GPU_DIR)/.stamp: Makefile | $(VENV)/.stamp
	$(PY) -m pip install -q --no-cache-dir --no-deps --upgrade --target $(TRITON_GPU_DIR) "$(TRITON_GPU)"
	touch $@

# DEVICE=cuda: the CUDA backends too (FA4, the CUTLASS DSL, FlashInfer: the package's cuda extra).
# torch comes from pip as above: on a machine whose pip gives a CPU build, the demo's preflight
# says so (install a CUDA build of torch 2.11-2.13 into .venv, or set TORCH).
$(VENV)/.cuda-stamp: pyproject.toml | $(VENV)/.stamp
	$(PY) -m pip install -q --no-cache-dir -e ".[test,cuda]"
	touch $@

setup: $(VENV)/.stamp

demo: setup $(if $(filter cuda,$(DEVICE)),$(VENV)/.cuda-stamp)
	$(PY) -m rlk_ops demo --device $(DEVICE) $(DEMO_ARGS)

# The first run goes over 2 workers, one test file per worker (--dist loadfile: a file's module fixtures,
# the demo report and the compiled models, are built once) and one torch thread per worker (tests/conftest.py).
# Session 43, idle machine, in this checkout: one process 533 s wall / 700 s CPU; -n 2 --dist worksteal 452 s /
# 845 s (fixtures built on both workers); -n 2 --dist loadfile 369 s / 718 s; a second pair, loadfile first:
# 370 s, then one process 519 s (1322 passed, 814 skipped each). In a fresh clone (CI, cold caches) loadfile
# took 434 s, make test 725 s in all.
# Session 42's -n 2 (default distribution, 2 threads per worker) had shown no gain (417 s against 423-548 s).
test: setup $(TRITON_GPU_DIR)/.stamp $(CUTE_GPU_DIR)/.stamp
	$(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n 2 -m "not cuda" $(PYTEST_ARGS) tests/test_triton_pair_decode.py tests/test_index_checks.py tests/test_mutation_value_checks.py \
		tests/test_triton_interpret.py tests/test_mutation_pair_decode.py tests/test_triton_logprobs.py
	PYTHONPATH=$(TRITON_GPU_DIR) RLK_SM90_TRITON=$(subst triton==,,$(TRITON_GPU)) $(PY) -m pytest -q $(PYTEST_ARGS) tests/test_sm90_compile.py
	PYTHONPATH=$(CUTE_GPU_DIR):$(CUTE_GPU_DIR)/nvidia_cutlass_dsl/dsl_packages $(PY) -m pytest -q $(PYTEST_ARGS) tests/test_fa4_walk_compile.py

inspect: setup
	$(PY) -m rlk_ops inspect

bench: setup
	$(PY) benchmarks/dispatch.py

clean:
	rm -rf $(VENV) $(TRITON_GPU_DIR) $(CUTE_GPU_DIR) .pytest_cache .hypothesis
