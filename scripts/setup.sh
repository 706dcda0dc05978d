#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: a venv in .venv, torch (the CPU 2.13.0 build when none is
# importable; a CUDA machine brings its own), then this package with its test, Hydra, Hugging Face and
# Accelerate extras (so no test is skipped for a missing package).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -e ".[dev,hydra,hf,accelerate]" 2>&1 | grep -v "^WARNING: Location" || true
# litgpt's GPT for the pipeline tests, without its pins (huggingface_hub<1.4 conflicts with transformers 5;
# the tests use litgpt.model and litgpt.config only, whose imports the packages above satisfy)
if ! .venv/bin/python -c "import litgpt.model" >/dev/null 2>&1; then
  .venv/bin/pip install -q --no-deps litgpt==0.5.13 2>&1 | grep -v "^WARNING: Location" || true
fi
# bytecode for this checkout, as pip writes it for installed packages: every torchrun worker imports the package and
# the tests, and a machine with PYTHONDONTWRITEBYTECODE set would otherwise compile them from source in each one
.venv/bin/python -m compileall -q lightning_autopar tests examples >/dev/null
.venv/bin/python -c "import lightning_autopar, torch; print('autopar set-up ok: torch', torch.__version__)"
