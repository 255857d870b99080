# The checkout's own paths, even when this Makefile is reached through a link (ci/readme_commands.py
# runs the README from a folder of links): an install from there would tie the venv's scripts and
# editable package to that temporary folder.
ROOT := $(patsubst %/,%,$(dir $(realpath $(firstword $(MAKEFILE_LIST)))))
VENV ?= $(ROOT)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# A CPU-only torch build is a fraction of the CUDA one's size: where pip can find it (a local
# wheel, a CPU index), the first install takes it; otherwise pip's default torch is used.
# On a GPU machine: make TORCH_CPU= (empty) installs the default build.
TORCH_CPU ?= torch==2.13.0+cpu

.PHONY: test train install clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) $(ROOT)/pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_CPU)" ]; then \
	  $(PY) -m pip install -q --only-binary=:all: "$(TORCH_CPU)" 2>/dev/null \
	    && echo "installed $(TORCH_CPU)" || echo "no $(TORCH_CPU) found; pip's default torch will be installed"; \
	fi
	$(PY) -m pip install -q -e "$(ROOT)[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

train: $(STAMP)
	$(VENV)/bin/portapipe train examples/cpu.yaml

clean:
	rm -rf $(VENV) runs .pytest_cache
