"""Undo the allocator setting a Dask nanny gives its worker.

A nanny starts its worker with ``MALLOC_TRIM_THRESHOLD_=65536``
(``distributed.nanny.pre-spawn-environ``), which makes glibc hand freed memory back to the
OS as soon as 64 KiB lie free at the top of the heap: torch's many short-lived tensors are
then mapped and faulted in again on every call (an update step of builtin:tiny-llama took
1.8x the time). The embedded local cluster removes the variable before its workers start;
workers an operator starts (``dask worker``) have it, and glibc read it at start-up, so a
role host sets the allocator back with ``mallopt`` itself.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD_BYTES = 64 << 20
"""Free memory kept at the top of the heap before it goes back to the OS: glibc's own
dynamic threshold grows to twice the largest mmap threshold, 64 MiB on 64-bit."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations above this are mapped apart: glibc's dynamic limit on 64-bit (setting the
trim threshold turns the dynamic adjustment off, which would otherwise leave 128 KiB)."""


def undo_nanny_malloc_trim() -> bool:
    """Set glibc's trim and mmap thresholds as an unset environment leaves them grown, when
    this process was started with ``MALLOC_TRIM_THRESHOLD_``; True when it did."""
    if not os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the variable meant nothing here
        return False
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
