"""A node call under ``torch.profiler`` (``trainer.torch_profile``).

The run's own profiler says how long each node takes; this says where the time goes inside
one: every operator and, on a GPU, every kernel, as a Chrome trace and as a table by own
time. Files go to the call's ``profile_dir`` on the worker's machine:
``NODE.trace.json`` and ``NODE.txt`` (``NODE-partK`` for part K of a node split over
devices); a worker that cannot write there writes to its temporary folder instead
(:func:`fallback_folder`).
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

TABLE_ROWS = 60
"""Operators and kernels in the table, the most expensive first."""


def file_stem(node: str, shard: tuple[int, int]) -> str:
    index, count = shard
    return node if count == 1 else f"{node}-part{index}"


@contextlib.contextmanager
def profiled(directory: str, stem: str, on_gpu: bool) -> Iterator[None]:
    """Profile the block; on leaving it without an error, write the trace and the table."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as recorded:
        yield
        if on_gpu:
            torch.cuda.synchronize()  # the block's kernels finish inside the profile
    # A GPU call's time is its kernels'; a CPU call's is its operators' own.
    order = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    table = recorded.key_averages().table(sort_by=order, row_limit=TABLE_ROWS, max_name_column_width=90)
    # The folder is the driver's; a worker on another machine may not be able to write there
    # (another user, a read-only path). Diagnostics never stop the run: then the worker's
    # temporary folder.
    for folder in (Path(directory), fallback_folder(directory)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            recorded.export_chrome_trace(str(folder / f"{stem}.trace.json"))
            (folder / f"{stem}.txt").write_text(table + "\n")
            return
        except OSError as error:
            warnings.warn(f"could not write the torch profile of {stem} to {folder}: {error}", stacklevel=2)


def fallback_folder(directory: str) -> Path:
    """Where a worker that cannot write to ``directory`` writes instead: its machine's
    temporary folder, under ``flowrl-torch-profile/step-N``."""
    return Path(tempfile.gettempdir()) / "flowrl-torch-profile" / Path(directory).name
