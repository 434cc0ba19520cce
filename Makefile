# Two commands do everything on a fresh machine:  make book  ·  make test
# Setup is idempotent: the venv is made once, requirements are reinstalled only when
# requirements.txt or pyproject.toml change (a stamp file records the last install). pip compiles
# every module at install (63 of its 146 CPU seconds here): where PYTHONDONTWRITEBYTECODE is set,
# as here, nothing else ever writes the bytecode, and without it each process would compile what
# it imports (with --no-compile, make test's pytest took 12 min 38 s on a fresh clone, not
# 7 min 46 s).
SHELL := /bin/bash
# Python 3.11 (the torch wheel on disk is cp311); falls back to python3 where there is no python3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BOOK_KERNEL := $(VENV)/share/jupyter/kernels/tpattn-portable/kernel.json
VENDOR := vendor
MATHJAX := $(VENDOR)/mathjax/tex-chtml.js
JB := $(VENV)/bin/jupyter-book

.PHONY: setup book test test-lab test-portable test-browser lab bench clean

# torch's OpenMP threads spin between parallel regions. With several processes on few cores
# (pytest-xdist workers, notebook kernels, torchrun ranks, the book's parallel execution) the
# spinning threads take the cores the others need: idle threads sleep instead. Thread counts,
# and so every result, are unchanged. Measured (bench/omp_wait.py: 2 processes at once on 2 cores,
# each running every mode on every seed 5 times): 14.5 s of CPU unset, 5.6-6.1 s PASSIVE.
OMP_WAIT_POLICY ?= PASSIVE
export OMP_WAIT_POLICY

setup: $(STAMP) $(MATHJAX)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $(STAMP)

# MathJax 3 from the npm registry (not committed): the book renders math offline.
# Only what a page loads (of the package's 24 MB): the tex-chtml bundle, its fonts, the TeX
# extensions it autoloads and the a11y modules its menu loads (~2.6 MB). The build copies
# vendor/ to _build/html/_static/ (`html_static_path` in _config.yml).
MATHJAX_PARTS := tex-chtml.js output/chtml/fonts/woff-v2 input/tex/extensions a11y
$(MATHJAX):
	@mkdir -p $(VENDOR)
	cd $(VENDOR) && npm pack --silent mathjax@3.2.2 >/dev/null && rm -rf mathjax && mkdir mathjax \
	  && tar -xzf mathjax-3.2.2.tgz -C mathjax --strip-components=2 $(addprefix package/es5/,$(MATHJAX_PARTS)) \
	  && tar -xzf mathjax-3.2.2.tgz -C mathjax --strip-components=1 package/LICENSE \
	  && rm mathjax-3.2.2.tgz

# --all: re-read every page (notebooks still come from the execution cache, ~25 s here), so a
# warning raised by an unchanged page in an earlier build fails this build too; an incremental
# Sphinx build would skip that page and pass.
book: setup
	$(JB) build . --all -W -n --keep-going

# make test: import-linter's layers contract (.importlinter), then three steps; each runs even if an
# earlier one failed, and make test fails if any did:
# 1. pytest: unit/property/CLI/distributed tests under this machine's CPU kernels, and every
#    chapter under nbval in a kernel with portable CPU kernels (BOOK_KERNEL, below). nbval
#    executes every notebook from scratch; each notebook whose cells all passed is kept with the
#    outputs nbval just compared (tools/nbval_record.py, in _build/nbval-executed);
# 2. the book, which caches those executions instead of running the notebooks a second time
#    (book/_ext/tpattn_book.py: only for this package's digest and unchanged code cells);
# 3. pytest on the tests that read the built HTML (marker built_book): the browser test, ...
# Not here: every chapter in a real JupyterLab (marker lab), `make test-lab` below; CI runs both.
# On every core: pytest-xdist hands out whole modules and classes (--dist loadscope), so a
# notebook's nbval cells run in order in one kernel on one worker; PYTEST_WORKERS=0 runs each
# step in one process. JUNIT=PREFIX writes PREFIX-1.xml and PREFIX-3.xml (bench/test_time.py).
NBVAL := --nbval --nbval-kernel-name tpattn-portable --nbval-sanitize-with tests/nbval_sanitize.cfg
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --dist loadscope
RECORD := -p tools.nbval_record --record-executed _build/nbval-executed
JUNIT ?=
test: setup $(BOOK_KERNEL)
	@status=0; \
	$(VENV)/bin/lint-imports --config .importlinter || status=1; \
	$(PY) -m pytest -q $(XDIST) $(NBVAL) $(RECORD) -m "not built_book and not lab" $(if $(JUNIT),--junitxml=$(JUNIT)-1.xml) tests book || status=1; \
	$(JB) build . --all -W -n --keep-going || status=1; \
	$(PY) -m pytest -q $(XDIST) -m "built_book and not lab" $(if $(JUNIT),--junitxml=$(JUNIT)-3.xml) tests || status=1; \
	exit $$status

# The chapters' kernel for nbval: this venv's Python with torch's portable kernels
# (ATEN_CPU_CAPABILITY=default), MKL's portable code path (MKL_CBWR=COMPATIBLE) and one thread,
# all at once (a kernel spec's "env"; the tests in the same pytest run keep this machine's
# kernels). The stored outputs were made on another machine, so none may depend on a CPU's
# rounding: a chapter prints rounding-level numbers through tests/nbval_sanitize.cfg. Measured on
# an AVX2 AMD EPYC (torch 2.13, MKL): each switch changes results (a 100003-term float32 sum, a
# 64x256x64 matmul, the seed matrix's digits), and MKL_CBWR=COMPATIBLE reproduces an AVX-512
# Xeon's seed-17 loss difference of missing_output_reduce.
$(BOOK_KERNEL): $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name tpattn-portable \
	  --display-name "Python 3 (portable CPU kernels)" --env ATEN_CPU_CAPABILITY default \
	  --env MKL_CBWR COMPATIBLE --env OMP_NUM_THREADS 1

# Every chapter in a real JupyterLab driven by headless Chromium (tests/book/test_lab.py, issue 9):
# open, Run All, no raw directive, the shown code is the package's, an explorer answers a click.
# It runs every chapter a second time, in a browser: about as long as all of `make test`'s pytest
# besides it (463 of 1001 worker-seconds when it was part of make test), and only a frontend
# change can break what it checks beyond make test's own checks (nbval runs every chapter,
# tests/book/test_source.py reads every markdown cell for raw directives). .ci/run runs it after
# make test.
test-lab: setup
	$(PY) -m pytest -q $(XDIST) -m lab $(if $(JUNIT),--junitxml=$(JUNIT)-lab.xml) tests

# The numeric tests again under other CPU kernels, so that no test depends on this machine's
# rounding (CI's and readers' CPUs have other kernels; make test already runs every chapter in
# BOOK_KERNEL). Each setting really switches kernels (see BOOK_KERNEL above; OMP_NUM_THREADS=1
# changes the float32 sum); with the native run and BOOK_KERNEL, torch's ATen code runs at three
# capabilities (the machine's, avx2, default), MKL on three paths (the machine's, SSE4.2,
# COMPATIBLE), torch on the machine's threads and on one. Runs the Llama-shape tolerance test
# under each. Does not rebuild the book.
PORTABLE_SETTINGS := "ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2" \
                     "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1"
NUMERIC_TESTS := tests/check/test_golden.py tests/check/test_rederive.py tests/check/test_properties.py tests/frontends/test_cli.py \
                 tests/check/test_tolerance_llama.py tests/check/test_tolerance_llama_sloppy.py
# The one test of those files that checks no number (the console script's install), run once.
NOT_NUMERIC := --deselect tests/frontends/test_cli.py::test_console_script_is_installed
KERNELS := import torch; print("kernels:", torch.backends.cpu.get_cpu_capability(), "threads:", torch.get_num_threads())
test-portable: setup
	@set -e; for s in $(PORTABLE_SETTINGS); do echo "== $$s"; env $$s $(PY) -c '$(KERNELS)'; \
	  env $$s $(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(NUMERIC_TESTS) $(NOT_NUMERIC); done

test-browser: book
	$(PY) -m pytest -q $(XDIST) tests/book/test_browser.py

lab: setup
	@echo "JupyterLab: open the http://127.0.0.1:8888/lab?token=... URL it prints below"
	$(VENV)/bin/jupyter lab book/ $$(if [ "$$(id -u)" = 0 ]; then echo --allow-root; fi)

# Issue 15's four speed figures first (bench/speed.py runs book_build, test_time,
# widget_latency, notebook_imports and sums them up), then every other benchmark, each by its
# defaults on this tree (a comparison with an older revision is each script's explicit option).
# Long: about 1.5-2.5 hours on 2 idle cores (speed.py ~30 min: make test and make test-lab;
# tolerance_headroom.py and tolerance_sweep.py ~1 hour together, their bfloat16 Llama-shape
# cases most of it); nothing in the tree is rewritten (tolerance_sweep.py writes _build/bench/).
# BENCH_FLAGS=--smoke runs each script's one tiny case instead (~1-2 min): what
# tests/package/test_bench_smoke.py checks.
SPEED_BENCHES := bench/speed.py bench/book_build.py bench/test_time.py bench/widget_latency.py \
                 bench/notebook_imports.py
BENCH_FLAGS ?=
bench: setup
	$(PY) bench/speed.py $(BENCH_FLAGS)
	@for b in $(filter-out $(SPEED_BENCHES),$(wildcard bench/*.py)); do echo "== $$b"; \
	  $(PY) $$b $(BENCH_FLAGS) || exit 1; done

clean:
	rm -rf _build
