"""No input makes a loader raise anything but a flowrl error (a clear message, exit code 2).

Hypothesis writes arbitrary text, arbitrary YAML-shaped data and mutations of the shipped
files into pipeline files, inventory files and dataset files; each load either succeeds or
raises a ``FlowrlError`` whose message names the file.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrl.data import PromptSource
from flowrl.devices.files import load_inventory
from flowrl.errors import FlowrlError
from flowrl.spec.loader import load_pipeline

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = (ROOT / "pipelines" / "grpo_tiny.yaml").read_text()
INVENTORY = sorted((ROOT / "devices").glob("*.yaml"))[0].read_text()
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=12))
data = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(string.ascii_lowercase + "_.", max_size=10), inner, max_size=4)),
    max_leaves=12)


def _mutations(text: str) -> st.SearchStrategy[str]:
    """The file with one line deleted, duplicated, cut or given a random tail."""
    lines = text.splitlines()

    def mutate(index: int, kind: int, junk: str) -> str:
        copy = list(lines)
        index %= len(copy)
        if kind == 0:
            del copy[index]
        elif kind == 1:
            copy.insert(index, copy[index])
        elif kind == 2:
            copy[index] = copy[index][: len(copy[index]) // 2]
        else:
            copy[index] = copy[index] + junk
        return "\n".join(copy) + "\n"

    return st.builds(mutate, st.integers(0, 10_000), st.integers(0, 3), st.text(max_size=8))


def _loads_or_explains(load: Callable[[Path], Any], text: str | bytes, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"input{suffix}"
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            load(path)
        except FlowrlError as error:
            assert str(error).strip(), "an empty error message"
            assert error.exit_code == 2


def _yaml_text(value: Any) -> str:
    return yaml.safe_dump(value, allow_unicode=True)


@FUZZ
@given(st.one_of(st.text(max_size=300), st.binary(max_size=200), data.map(_yaml_text), _mutations(PIPELINE)))
def test_pipeline_files(text: str | bytes) -> None:
    _loads_or_explains(load_pipeline, text, ".yaml")


@FUZZ
@given(st.one_of(
    st.text(max_size=300), data.map(_yaml_text), _mutations(INVENTORY),
    # a valid file's shape with values replaced
    st.builds(lambda value: INVENTORY.replace("80", str(value), 1), scalars),
))
def test_inventory_files(text: str | bytes) -> None:
    _loads_or_explains(load_inventory, text, ".yaml")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.text(max_size=40), data.map(json.dumps),
                          st.builds(lambda p, a: json.dumps({"prompt": p, "answer": a}), scalars, scalars)),
                max_size=6))
def test_dataset_files(lines: list[str]) -> None:
    # read by datasets (pyarrow); every failure must come out as a DataError
    _loads_or_explains(lambda path: PromptSource(path.name, 2, 0, path.parent), "\n".join(lines), ".jsonl")
