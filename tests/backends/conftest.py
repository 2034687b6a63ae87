"""Fixtures shared by the backend tests: one builtin tiny-llama, built once per session; and
running a script of Triton kernels under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.backends.builtin import builtin_model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache holding builtin:tiny-llama (never the user's ~/.cache)."""
    return builtin_model_dir("tiny-llama", tmp_path_factory.mktemp("flowrl-cache"))


ROOT = str(Path(__file__).resolve().parents[2])


def run_interpreted(script: str) -> list[str]:
    """The lines ``script`` prints, run in a new interpreter with ``TRITON_INTERPRET=1`` (Triton
    kernels on CPU tensors) and the repository first on its path (``{root}`` in the script).
    The script prints ``UNSUPPORTED ...`` and exits where this Triton's interpreter cannot run a
    kernel: some versions (with numpy 2) hand a kernel's integer arguments over as 1-element
    arrays, which a loop bound cannot take (the compiled kernel can); the test is then skipped."""
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-c", script.format(root=ROOT)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("UNSUPPORTED"):
        pytest.skip(f"this Triton's interpreter cannot run the kernel's loop: {result.stdout[12:200]}")
    return result.stdout.split("\n")
