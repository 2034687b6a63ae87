"""A pipeline's relative local paths made absolute, for the copy a run keeps.

Model folders, data files and reward modules are found relative to the pipeline file's
folder. The run's ``config.yaml`` lives elsewhere (its output folder), so it names them
absolutely: ``flowrl validate OUT/config.yaml``, ``flowrl resume OUT`` and a run started from
that copy all find what the run used. Hub names, builtin names and installed modules stay as
they are.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.backends.cache import BUILTIN_PREFIX
from flowrl.data.files import resolve_local
from flowrl.graph import PipelineGraph
from flowrl.spec.schema import ScoreNode


def absolute_paths(graph: PipelineGraph, base_dir: Path | None) -> PipelineGraph:
    """``graph`` with every relative path that names something in ``base_dir`` (None: the
    working directory) absolute."""
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    spec = graph.spec
    models = {name: model.model_copy(update={"path": _folder(model.path, base)})
              for name, model in spec.models.items()}
    data = spec.data.model_copy(update={"source": _data(spec.data.source, base)})
    evaluation = spec.eval
    if evaluation is not None and evaluation.source:
        evaluation = evaluation.model_copy(update={"source": _data(evaluation.source, base)})
    nodes = {name: node.model_copy(update={"fn": _reward(node.fn, base)})
             if isinstance(node, ScoreNode) and isinstance(node.fn, str) else node
             for name, node in spec.nodes.items()}
    changed = spec.model_copy(update={"models": models, "data": data, "eval": evaluation, "nodes": nodes})
    return graph if changed == spec else PipelineGraph(changed)


def _folder(path: str, base: Path) -> str:
    if path.startswith(BUILTIN_PREFIX) or Path(path).expanduser().is_absolute():
        return path
    candidate = base / Path(path).expanduser()
    return str(candidate.resolve()) if candidate.is_dir() else path


def _data(source: str, base: Path) -> str:
    if source.startswith(BUILTIN_PREFIX) or Path(source).expanduser().is_absolute():
        return source
    found = resolve_local(source, base)
    return str(found.resolve()) if found is not None else source


def _reward(fn: str, base: Path) -> str:
    """``module:function`` of a module file in ``base`` (or ``file.py:function``) with the
    file's absolute path; registry names and installed modules unchanged."""
    module, colon, function = fn.strip().partition(":")
    if not colon:
        return fn
    relative = Path(module) if module.endswith(".py") else Path(module.replace(".", "/") + ".py")
    if relative.expanduser().is_absolute():
        return fn
    candidate = base / relative.expanduser()
    return f"{candidate.resolve()}:{function}" if candidate.is_file() else fn
