# Two commands do everything on a fresh machine:  make book  ·  make test
# Setup is idempotent: the venv is made once, requirements are reinstalled only when
# requirements.txt or pyproject.toml change (a stamp file records the last install).
SHELL := /bin/bash
# Python 3.11 (the torch wheel on disk is cp311); falls back to python3 where there is no python3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VENDOR := vendor
MATHJAX := $(VENDOR)/mathjax/tex-chtml.js
JB := $(VENV)/bin/jupyter-book

.PHONY: setup book test test-browser lab bench clean

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

# One pytest run: unit/property/CLI/distributed tests, every chapter notebook under nbval,
# and the browser test of the HTML that `book` just built.
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
test: book
	$(PY) -m pytest -q $(NBVAL) tests book

test-browser: book
	$(PY) -m pytest -q tests/test_browser.py

lab: setup
	$(VENV)/bin/jupyter lab book/

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf _build
