"""A role host on a worker that a Dask nanny started sets glibc's allocator back from the
nanny's MALLOC_TRIM_THRESHOLD_=65536."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

from flowrl.runtime.malloc import undo_nanny_malloc_trim

pytestmark = pytest.mark.skipif(ctypes.util.find_library("c") is None or sys.platform != "linux",
                                reason="glibc only")


def test_only_a_process_started_with_the_nanny_s_setting_changes_its_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert undo_nanny_malloc_trim() is False
    # in a process of its own, started as a nanny starts its worker
    code = "from flowrl.runtime.malloc import undo_nanny_malloc_trim as undo; print(undo())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"MALLOC_TRIM_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "True"
