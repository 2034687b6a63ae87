"""Reading a dataset split with the ``datasets`` library, wherever the user keeps it.

``data.source`` (or ``eval.source``) may be:

* a data file: ``.parquet``, ``.jsonl`` / ``.json`` (JSON Lines or a JSON array), ``.csv``;
  a single file is one split, ``train``;
* a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``, or a folder
  of data files whose names say their split (``train.parquet``, ``test-00000.parquet``);
* a hub dataset name (``openai/gsm8k``) with an optional ``subset`` (its configuration).

Relative paths are resolved against the pipeline file's folder. Without network a hub name
fails at once with what to do instead (``save_to_disk`` elsewhere, then point at the folder).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowrl.backends.hub import HUB_NAME_PATTERN, HUB_PROBE_TIMEOUT_S, hub_offline, hub_reachable
from flowrl.data.jsonl import check_json_lines
from flowrl.errors import DataError, error_chain

FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
"""Data file suffix -> the ``datasets`` builder that reads it."""

SINGLE_SPLIT = "train"
"""The split name of a single data file (as ``datasets`` names it)."""

SPLIT_FIELD = "split"
"""``DataError.field`` of a split that is not there, relative to the pipeline section that
named it (``read_examples`` makes it ``data.split`` or ``eval.split``)."""
SUBSET_FIELD = "subset"
"""``DataError.field`` of a configuration that is not there, or that must be chosen (as
:data:`SPLIT_FIELD`)."""

SPLIT_FOLDERS = frozenset({"data", "train", "test", "validation", "valid", "dev", "eval", "evaluation"})
"""Folder names that hold a dataset's files or one split of them, not a configuration."""


def _quiet() -> None:
    # "Generating train split" bars from every load clutter the run's log.
    from datasets.utils import logging as datasets_logging  # type: ignore[import-untyped]

    datasets_logging.disable_progress_bar()
    # Reader failures are logged before they are raised; the DataError says it once.
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)


def resolve_local(source: str, base_dir: Path | None) -> Path | None:
    """The local file or folder ``source`` names (pipeline folder first), or None."""
    path = Path(source).expanduser()
    candidates = [path] if path.is_absolute() or base_dir is None else [Path(base_dir) / path, path]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    return None


def missing_local_source(source: str, base_dir: Path | None) -> str | None:
    """Why ``source`` cannot be a dataset: it names a local file or folder that is not there
    (not a hub name); None when it exists or may be a hub dataset."""
    if resolve_local(source, base_dir) is not None:
        return None
    if source.startswith((".", "/", "~")) or Path(source).suffix in FILE_BUILDERS or not HUB_NAME_PATTERN.match(source):
        folders = list(dict.fromkeys(str(folder) for folder in (base_dir, Path.cwd()) if folder is not None))
        where = f" (looked in {' and '.join(folders)})" if base_dir is not None else ""
        return (
            f"data source '{source}' not found{where}; give a .parquet, .jsonl, .json or .csv "
            "file, a folder written by save_to_disk, a hub dataset name, or a built-in task "
            "such as builtin:digits"
        )
    return None


def has_splits(source: str, base_dir: Path | None) -> bool:
    """Whether ``source`` can hold several splits (a folder or a hub name, not one file)."""
    local = resolve_local(source, base_dir)
    if local is None:
        return True
    return local.is_dir() and not (local / "state.json").is_file()


def load_split(source: str, split: str, subset: str | None, base_dir: Path | None) -> Any:
    """The ``datasets.Dataset`` of ``split`` of ``source``; DataError saying what to do."""
    _quiet()
    local = resolve_local(source, base_dir)
    if local is not None:
        if local.is_dir():
            return _load_folder(local, source, split, subset)
        return _load_file(local, source, split)
    missing = missing_local_source(source, base_dir)
    if missing is not None:
        raise DataError(missing)
    return _load_hub(source, split, subset)


def _wrong_split(source: str, split: str, known: list[str]) -> DataError:
    return DataError(
        f"{source} has no split '{split}'; its splits are: {', '.join(known)} "
        "(set data.split or eval.split)", field=SPLIT_FIELD
    )


def _load_file(path: Path, source: str, split: str) -> Any:
    import datasets  # type: ignore[import-untyped]

    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"data file {source} has suffix '{path.suffix}'; expected one of "
            f"{', '.join(FILE_BUILDERS)} (or a folder written by save_to_disk)"
        )
    if split != SINGLE_SPLIT:
        raise DataError(
            f"{source} is a single data file, which is the split '{SINGLE_SPLIT}'; asked for "
            f"split '{split}': set the split to {SINGLE_SPLIT}, or give a folder or hub dataset "
            "that has that split", field=SPLIT_FIELD
        )
    if _empty_file(path):
        example = ", e.g. one JSON object per line" if builder == "json" else ""
        raise DataError(f"data file {source} is empty (it has no rows); write one example per row{example}")
    if builder == "json":
        # Checked before pyarrow reads it: pyarrow's JSON reader crashes the process (a
        # segmentation fault, pyarrow 26) on a line that is not an object, such as `null`.
        check_json_lines(path, source)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split=SINGLE_SPLIT)
    except Exception as error:  # noqa: BLE001 - any reader failure is a problem with the file
        raise DataError(f"cannot read data file {source}: {_reason(error)}") from error


def _empty_file(path: Path) -> bool:
    """No rows: no bytes, a text format with only white space, a CSV file with its header
    line alone, or a Parquet file whose footer counts no row (``datasets`` says only
    "corresponds to no data" or a reader's batch-size error for these)."""
    if path.stat().st_size == 0:
        return True
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return bool(pq.ParquetFile(path).metadata.num_rows == 0)
        except Exception:  # noqa: BLE001 - not a Parquet file: the reader's own error says so
            return False
    filled = 0
    with path.open("rb") as lines:
        for line in lines:  # two lines with text are enough to know
            filled += bool(line.strip())
            if filled == 2:
                return False
    return filled == 0 or builder == "csv"


def configurations(path: Path) -> list[str]:
    """The configurations of a downloaded hub dataset's folder: its folders that hold data
    files and are not named as a split (``main/``, ``socratic/`` of openai/gsm8k). A folder
    with data files of its own is one dataset, whatever folders sit beside them."""
    if any(item.suffix.lower() in FILE_BUILDERS and item.is_file() for item in path.iterdir()):
        return []
    return sorted(item.name for item in path.iterdir()
                  if item.is_dir() and not item.name.startswith(".") and item.name.lower() not in SPLIT_FOLDERS
                  and any(file.suffix.lower() in FILE_BUILDERS for file in item.rglob("*")))


def _load_folder(path: Path, source: str, split: str, subset: str | None = None) -> Any:
    import datasets

    saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    found = [] if saved else configurations(path)
    if subset is not None:
        if subset not in found:
            has = f"its configurations (a folder each): {', '.join(found)}" if found else "it has none: remove the subset"
            raise DataError(f"{source} has no configuration '{subset}'; {has}", field=SUBSET_FIELD)
        path, source = path / subset, f"{source}/{subset}"
    elif len(found) > 1:
        # read whole, their rows would be mixed into one split
        raise DataError(f"{source} holds {len(found)} configurations, a folder each ({', '.join(found)}): set the "
                        "subset to the one to read", field=SUBSET_FIELD)
    if saved:
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as error:  # noqa: BLE001
            raise DataError(f"cannot read the saved dataset in {source}: {_reason(error)}") from error
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise _wrong_split(source, split, list(loaded))
            return loaded[split]
        if split != SINGLE_SPLIT:
            raise DataError(
                f"{source} holds a single saved Dataset, which is the split '{SINGLE_SPLIT}'; "
                f"asked for '{split}': set the split to {SINGLE_SPLIT}, or save a DatasetDict", field=SPLIT_FIELD
            )
        return loaded
    # at the top or in folders below it, as a hub dataset's download keeps them (data/train-00000-of-00002.parquet);
    # datasets reads the splits from the file and folder names
    files = [item for item in sorted(path.rglob("*")) if item.suffix.lower() in FILE_BUILDERS and item.is_file()
             and not any(part.startswith(".") for part in item.relative_to(path).parts)]
    if not files:
        raise DataError(
            f"folder {source} holds neither a dataset written by save_to_disk nor data files "
            f"({', '.join(FILE_BUILDERS)})"
        )
    empty = [str(item.relative_to(path)) for item in files if _empty_file(item)]
    if empty:
        # datasets says only "StopIteration" or "corresponds to no data" for these
        raise DataError(f"folder {source} has empty data file{'s' if len(empty) > 1 else ''} {', '.join(empty)} "
                        f"(split '{split}' is read, and every file of the folder is loaded with it); write one "
                        "example per row, or remove the file")
    for item in files:  # a bad line named by its file and line (see _load_file)
        if FILE_BUILDERS[item.suffix.lower()] == "json":
            check_json_lines(item, f"{source}/{item.relative_to(path)}")
    try:
        loaded = datasets.load_dataset(str(path))
    except Exception as error:  # noqa: BLE001
        raise DataError(f"cannot read the data files in {source}: {_reason(error)}") from error
    if split not in loaded:
        raise _wrong_split(source, split, list(loaded))
    return loaded[split]


def _load_hub(name: str, split: str, subset: str | None) -> Any:
    import datasets

    offline = hub_offline() or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    # Asked first: without network, datasets retries its requests for half a minute before it
    # gives up; offline it reads its cache only, at once.
    offline = offline or not hub_reachable(HUB_PROBE_TIMEOUT_S)
    try:
        # A copy in the local datasets cache loads without network.
        with _offline_mode(offline):
            return datasets.load_dataset(name, subset, split=split, download_mode="reuse_dataset_if_exists")
    except Exception as cached_error:  # noqa: BLE001 - decided below: offline or a real problem
        if offline:
            raise DataError(
                f"dataset '{name}' is not a local file or folder and the hub cannot be reached; "
                f"on a machine with network run: datasets.load_dataset('{name}'"
                f"{', ' + repr(subset) if subset else ''}).save_to_disk('DIR'), copy DIR here and "
                "set data.source to it"
            ) from cached_error
        if isinstance(cached_error, ValueError) and "split" in str(cached_error).lower():
            raise DataError(f"dataset '{name}': {_reason(cached_error)} (set data.split)",
                            field=SPLIT_FIELD) from cached_error
        raise DataError(f"cannot load dataset '{name}': {_reason(cached_error)}") from cached_error


@contextlib.contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """datasets (and the hub client under it) in offline mode for one load, when ``offline``."""
    import datasets.config  # type: ignore[import-untyped]
    import huggingface_hub.constants

    if not offline:
        yield
        return
    saved = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def _reason(error: BaseException) -> str:
    """The most telling message of an exception chain (datasets wraps the reader's error)."""
    messages: list[str] = []
    for link in error_chain(error):
        if len(messages) == 4:
            break
        text = str(link).strip()
        if text:
            messages.append(f"{type(link).__name__}: {text.splitlines()[0]}")
    return messages[-1] if messages else type(error).__name__
