# Entry points: `make run` starts the whole mesh, `make test` runs the lint, then the tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
RUFF := $(PY) -m ruff
MYPY := $(PY) -m mypy
INSTALLED := $(VENV)/.installed
EDITABLE := $(VENV)/.editable
PROTOS := $(wildcard protos/infermesh/pb/*.proto)
GENERATED := infermesh/pb/.generated
MODEL_DIR := models/tiny-deepseek-v3
V32_DIR := models/tiny-deepseek-v32
MLA_DIR := models/tiny-deepseek-v3-mla
CHAT_DIR := models/tiny-deepseek-v3-chat
CHAT_CHECKPOINT := devtools/chat_model/checkpoint
THINKING_DIR := models/tiny-deepseek-v3-chat-thinking
THINKING_CHECKPOINT := devtools/chat_model/thinking
VLLM_INSTALLED := $(VENV)/.vllm-installed
BROWSER_INSTALLED := $(VENV)/.browser-installed
CHROMIUM := /usr/bin/chromium
IPTABLES := /usr/sbin/iptables
# the router's compiled prefix lookup (router_svc/_prefix_probe.c), built with the C compiler; its
# suffix asked of the interpreter that makes the venv (a rule's target is named when the Makefile is
# read, before a clean checkout has a venv to ask)
NATIVE = router_svc/_prefix_probe$(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")

.PHONY: all venv install vllm browser proto native model model-v2 model-v32 model-mla model-r1 model-v31 \
	run lint test netfaults console-screenshots bench clean chat-model

all: proto native model

$(INSTALLED): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(INSTALLED)

# This project, editable (pyproject.toml lists its packages), so the benches and tools import it
# from anywhere. Built with the venv's pinned setuptools (--no-build-isolation): nothing fetched.
$(EDITABLE): pyproject.toml $(INSTALLED)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps --editable .
	touch $@

install: $(EDITABLE)

# The optional vLLM engine ([engine] kind = "vllm"); --no-deps: see requirements-vllm.txt.
$(VLLM_INSTALLED): requirements-vllm.txt $(INSTALLED)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-vllm.txt
	touch $@

vllm: $(VLLM_INSTALLED) model-mla

# The console's browser test: Playwright for Python driving Debian's Chromium (no browser is
# downloaded; apt-get needs root, as on the test machines).
$(CHROMIUM):
	apt-get update -qq && apt-get install -y -qq chromium

$(BROWSER_INSTALLED): requirements-browser.txt $(INSTALLED)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-browser.txt
	touch $@

browser: $(BROWSER_INSTALLED) $(CHROMIUM)

# The network-fault tests (tests/e2e/test_network_faults.py): Debian's iptables drops packets in
# the tests' own network namespace (tc and ss come with iproute2); apt-get needs root, as the
# tests do.
$(IPTABLES):
	apt-get update -qq && apt-get install -y -qq iptables iproute2

netfaults: $(IPTABLES)

# Python, .pyi stubs and gRPC stubs from protos/; never edited by hand.
$(GENERATED): $(PROTOS) $(INSTALLED)
	rm -rf infermesh/pb
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch infermesh/pb/__init__.py $@

proto: $(GENERATED)

# The router's prefix index lookup in C over CPython's API (router_svc/prefix_index.py loads it;
# a router configured with [routing] index = "compiled" refuses to start without it).
$(NATIVE): router_svc/_prefix_probe.c $(INSTALLED)
	$(CC) -O2 -shared -fPIC -Wall -Wextra -Werror \
		-I$(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])") -o $@ $<

native: $(NATIVE)

# The tiny DeepSeek-V3 checkpoint with random weights, which the tests serve.
$(MODEL_DIR)/config.json: $(GENERATED) devtools/tiny_model.py
	$(PY) -m devtools.tiny_model $(MODEL_DIR)

# The default model `make run` serves: the same tiny DeepSeek-V3 trained to chat, stored in the
# repository beside the command that rebuilds it (`make chat-model`).
# Refused (naming the file) when a stored file is not the one its manifest.json hashes.
$(CHAT_DIR)/config.json: $(CHAT_CHECKPOINT)/*
	$(PY) -m devtools.chat_model.manifest verify $(CHAT_CHECKPOINT)
	rm -rf $(CHAT_DIR)
	mkdir -p $(dir $(CHAT_DIR))
	cp -r $(CHAT_CHECKPOINT) $(CHAT_DIR)

# Its thinking variant (train.py's docstring), which the reasoning tests serve.
$(THINKING_DIR)/config.json: $(THINKING_CHECKPOINT)/*
	$(PY) -m devtools.chat_model.manifest verify $(THINKING_CHECKPOINT)
	rm -rf $(THINKING_DIR)
	mkdir -p $(dir $(THINKING_DIR))
	cp -r $(THINKING_CHECKPOINT) $(THINKING_DIR)

model: $(MODEL_DIR)/config.json $(CHAT_DIR)/config.json $(THINKING_DIR)/config.json

# Retrain the default chat model from scratch on its corpus (train.py's defaults: ~7 minutes on
# one H200, about six hours on two quiet CPU cores), then its thinking variant from it (~1 minute
# on a GPU, 12 on two cores), each stored with its training log and manifest; then `make model`.
chat-model: $(GENERATED)
	$(PY) -m devtools.chat_model.train
	$(PY) -m devtools.chat_model.train --init $(CHAT_CHECKPOINT) --out $(THINKING_CHECKPOINT) \
		--dialogues 20000 --steps 600 --batch-tokens 8192 --lr 6e-4 --thinking 0.5 --save-every 100

# Tiny DeepSeek-V2 and V2-Lite-shaped checkpoints (BF16, softmax gate), for serving or trying V2 locally.
V2_MODEL_DIRS := models/tiny-deepseek-v2 models/tiny-deepseek-v2-lite

models/tiny-deepseek-v2/config.json: $(GENERATED) devtools/tiny_model.py
	$(PY) -m devtools.tiny_model models/tiny-deepseek-v2 --v2

models/tiny-deepseek-v2-lite/config.json: $(GENERATED) devtools/tiny_model.py
	$(PY) -m devtools.tiny_model models/tiny-deepseek-v2-lite --v2-lite

model-v2: $(addsuffix /config.json,$(V2_MODEL_DIRS))
# The same tiny model as DeepSeek-V3.2 (sparse attention): `make model-v32`, then `--model $(V32_DIR)`.
$(V32_DIR)/config.json: $(GENERATED) devtools/tiny_model.py
	$(PY) -m devtools.tiny_model $(V32_DIR) --v32

model-v32: $(V32_DIR)/config.json

# Reasoning checkpoints of the tiny model: the think tags and DeepSeek-R1's or V3.1's chat template.
REASONING_DIRS := models/tiny-deepseek-r1 models/tiny-deepseek-v31

models/tiny-deepseek-r1/config.json: $(GENERATED) devtools/tiny_model.py devtools/templates/*
	$(PY) -m devtools.tiny_model models/tiny-deepseek-r1 --r1

models/tiny-deepseek-v31/config.json: $(GENERATED) devtools/tiny_model.py devtools/templates/*
	$(PY) -m devtools.tiny_model models/tiny-deepseek-v31 --v31

model-r1: models/tiny-deepseek-r1/config.json
model-v31: models/tiny-deepseek-v31/config.json

# The tiny model with DeepSeek's attention head sizes and BF16 weights, which vLLM's CPU build serves
# (its MLA kernels take only a 512 + 64 latent head; its FP8 linear kernels need AMX).
$(MLA_DIR)/config.json: $(GENERATED) devtools/tiny_model.py
	$(PY) -m devtools.tiny_model $(MLA_DIR) --mla --bf16

model-mla: $(MLA_DIR)/config.json

run: install proto native model
	$(PY) -m infermesh run

# ruff and mypy, configured in pyproject.toml; mypy reads the generated .pyi stubs.
lint: install proto native $(BROWSER_INSTALLED)
	$(RUFF) check .
	$(RUFF) format --check .
	$(MYPY)

# vLLM too: its engine's tests (tests/e2e/test_vllm.py) run, never skipped; the browser
# the console's test drives (tests/gateway/console/test_console_browser.py); and iptables, with
# which the network-fault tests drop packets. The tests run on
# TEST_WORKERS pytest-xdist workers, a module's tests on one worker (--dist loadfile: its module
# fixtures, some starting processes, run once; pytest 9 ignores the node ids --dist loadgroup
# rewrites, so its groups would be split); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile

# --durations: the slowest tests, named at the end of every run (the suite's 8-minute budget).
test: lint install proto native model vllm browser netfaults
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=12

# The console's screenshots in docs/console/, taken again by its browser test.
console-screenshots: install proto model browser
	INFERMESH_CONSOLE_SCREENSHOTS=docs/console $(PY) -m pytest -n 0 tests/gateway/console/test_console_browser.py

# The hardware study against OPENAI_BASE_URL (see docs/HARDWARE.md); BENCH_ARGS=--sim for a
# simulated fleet on this machine.
bench: install proto model
	$(PY) -m infermesh bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) infermesh/pb $(MODEL_DIR) $(CHAT_DIR) $(THINKING_DIR) $(V2_MODEL_DIRS) $(V32_DIR) $(MLA_DIR) \
		$(REASONING_DIRS)
