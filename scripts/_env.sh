# Sourced by scripts/main and scripts/test: make .venv and install the project into it.
# LFA_TORCH picks the torch install: "torch==2.13.0" (default, CPU build) or "skip" when the venv
# already holds the CUDA build you installed yourself (see README, "GPU").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${LFA_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.lfa-installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) ${LFA_TORCH:-torch==2.13.0}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "Installing lightning-fasync into $VENV ..."
  "$PY" -m pip install --quiet --upgrade pip
  if [ "${LFA_TORCH:-torch==2.13.0}" != "skip" ]; then
    "$PY" -m pip install --quiet "${LFA_TORCH:-torch==2.13.0}"
  fi
  "$PY" -m pip install --quiet -e ".[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"
