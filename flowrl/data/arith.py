"""``builtin:arith``: one- and two-digit addition and subtraction, as a dataset with splits.

A prompt is an expression and ``=``, the answer its value (``-`` when negative)::

    37+45=    82          23-45=    -22          7+5=    12

Every ``a+b`` and ``a-b`` with a, b in 0..99 (20,000 problems); 500 of them, drawn from a
fixed seed, are the ``test`` split and the others the ``train`` split, so no held-out
problem is ever trained on. The problems are those of
:mod:`flowrl.backends.arith_model` (``builtin:arith-llama`` is fitted on the same train
split). The dataset is written once as ``train.parquet`` and ``test.parquet`` (columns
``prompt``, ``answer``) under the cache root::

    <cache root>/data/arith-v<version>/train.parquet  test.parquet

into a private temporary folder renamed into place, like the builtin models.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.backends.arith_problems import ArithData, arith_problems
from flowrl.backends.cache import cache_root, write_once
from flowrl.errors import DataError

SPLITS: tuple[str, ...] = ("train", "test")


def arith_dataset_dir(cache_dir: Path | None = None, data: ArithData = ArithData()) -> Path:
    """The folder holding ``train.parquet`` and ``test.parquet``, written on first use."""
    target = cache_root(cache_dir) / "data" / f"arith-{data.num_test}-s{data.seed}-v{data.version}"
    # test.parquet is written last (``write_arith_dataset``): it marks a complete folder
    return write_once(target, "test.parquet", lambda folder: write_arith_dataset(data, folder),
                      "the arithmetic dataset", DataError)


def write_arith_dataset(data: ArithData, directory: Path) -> None:
    """One parquet file per split in ``directory``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, problems in arith_problems(data).items():
        table = pa.table({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
        pq.write_table(table, directory / f"{split}.parquet")
