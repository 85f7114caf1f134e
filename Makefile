# The CPU build of torch is pinned first: a bare `torch` requirement would pull a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo serve lint

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[test]'
	touch $(STAMP)

# two workers, a test file each at a time (module fixtures start once): the suite waits on
# servers and subprocesses as much as it computes
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

demo: $(STAMP)
	$(VENV)/bin/mlaserve generate --prompt "$$(printf 'Question: What is 48 + 35 - 17?\nAnswer:')" --max-tokens 40 --temperature 0

serve: $(STAMP)
	$(VENV)/bin/mlaserve serve --device cpu --host 127.0.0.1 --port 8000

lint: $(STAMP)
	$(VENV)/bin/ruff check mlaserve tests
