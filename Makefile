# The two commands: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch==2.13.0 is pinned: on the project's CPU machines pip takes a CPU build from
# local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# Triton for its interpreter (TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors): the
# second pytest run of `make test` checks the decode pair kernel's arithmetic order, launch rules
# and bad arguments there. 3.9: 3.6's interpreter (the Triton the H200 compiles with) fails on
# these kernels (a scalar conversion TypeError).
TRITON ?= triton==3.9.0
DEVICE ?= cpu
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test bench inspect clean

$(VENV)/.stamp: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.stamp

demo: setup
	$(PY) -m rlk_ops demo --device $(DEVICE) $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not cuda" $(PYTEST_ARGS) tests/test_triton_pair_decode.py

inspect: setup
	$(PY) -m rlk_ops inspect

bench: setup
	$(PY) benchmarks/dispatch.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
