"""Turning a score node's ``fn`` string into a callable.

``fn`` is a registry name (``digits``), ``module:function`` or ``path/file.py:function``. A
module is looked up in two places only, in this order: a ``.py`` file in the pipeline's own
folder (``base_dir``), then the installed packages; a file path is read as given when
absolute, else from the pipeline's folder. That folder goes on ``sys.path`` after the entries
the process had (for the helper modules a reward module imports; see ``_from_folder``), so a
file there cannot shadow an installed module.

Resolve on the process that calls the function (each Dask worker resolves the string itself):
a function loaded from a file is not importable by name elsewhere, so it does not pickle.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
import threading
import traceback
import types
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

from flowrl.errors import RewardError
from flowrl.rewards.builtin import REWARD_FUNCTIONS, RewardFunction
from flowrl.spec.schema import PythonFunction


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


_UNIQUE_PREFIX = "flowrl_pipeline_"


def _load_file_module(module_name: str, path: Path) -> ModuleType:
    # A name unique to the file, so two pipelines' "rewards.py" never collide in sys.modules;
    # registered while it runs because dataclasses and pickling look modules up there.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    unique_name = f"{_UNIQUE_PREFIX}{digest}_{module_name.replace('.', '_')}"
    spec = importlib.util.spec_from_file_location(unique_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"cannot load reward module {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(unique_name, None)
        hint = ""
        if isinstance(error, ImportError) and "no known parent package" in str(error):
            hint = _relative_import_hint(path)
        raise RewardError(
            f"importing reward module {path} failed{_line_in(error, path)}: {type(error).__name__}: {error}{hint}"
        ) from error
    return module


def _relative_import_hint(path: Path) -> str:
    """What to write for a module loaded by its file that imports relatively."""
    packages: list[str] = []
    folder = path.parent
    while (folder / "__init__.py").is_file():
        packages.insert(0, folder.name)
        folder = folder.parent
    if not packages:
        return "; a module that is not in a package (a folder with __init__.py) imports absolutely: import helpers"
    return (f"; a module of a package is named by its dotted name, fn: {'.'.join([*packages, path.stem])}:FUNCTION, "
            f"with the package in the pipeline file's folder")


def _line_in(error: BaseException, path: Path) -> str:
    """`` at line N`` of ``path`` where the error was raised while its module ran (a
    SyntaxError names its own line in its message)."""
    if isinstance(error, SyntaxError):
        return ""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if Path(frame.filename) == path]
    return f" at line {lines[-1]}" if lines and lines[-1] is not None else ""


_LOCK = threading.RLock()
"""Loading reward modules changes ``sys.path`` and ``sys.modules``: one load at a time (the
role hosts of two runs sharing a worker each have a thread of their own)."""
_APPENDED: list[str] = []
"""The pipeline folders this process put on ``sys.path`` itself."""
_IMPORTED_BEFORE: dict[str, frozenset[str]] = {}
"""Per pipeline folder, the modules imported already when a reward of its was first loaded:
never taken for its helpers (flowrl itself may live in that folder)."""
_SEEN: dict[str, float] = {}
"""Each helper file's modification time when it was first seen imported."""


@contextmanager
def _from_folder(folder: Path) -> Iterator[None]:
    """Around loading a reward module of the pipeline in ``folder``: let it import its helper
    modules and packages there, when it is loaded and when its functions run. The folder goes
    on ``sys.path`` after every entry that was there before, so that a file there named like
    an installed or standard module (``random.py``) shadows nothing.

    One process may load the rewards of many pipelines (a worker of a joined cluster lives
    across runs; a notebook runs one pipeline after another). A pipeline's helpers are the
    modules found directly in its folder (``helpers.py``, ``package/``) that were not
    imported before its first reward was; loading a reward forgets the helpers of every other
    pipeline folder, and the ones of its own folder edited since, so that they are imported
    afresh, and puts its folder before the other pipeline folders on ``sys.path``. Functions
    loaded before keep the helper modules they were loaded with."""
    entry = str(folder.resolve())
    with _LOCK:
        for other in [known for known in _IMPORTED_BEFORE if known != entry]:
            for name, _ in _helpers(other):
                sys.modules.pop(name, None)
        if entry in _IMPORTED_BEFORE:
            for name, found in _helpers(entry):
                if _modified(found) != _SEEN.get(found):
                    sys.modules.pop(name, None)
                    _SEEN.pop(found, None)
        else:
            _IMPORTED_BEFORE[entry] = frozenset(sys.modules)
        if entry in _APPENDED:
            _APPENDED.remove(entry)
            while entry in sys.path:
                sys.path.remove(entry)
        if entry not in sys.path:
            ours = [index for index, path in enumerate(sys.path) if path in _APPENDED]
            sys.path.insert(ours[0] if ours else len(sys.path), entry)
            _APPENDED.append(entry)
        try:
            yield
        finally:
            for _, found in _helpers(entry):
                _SEEN.setdefault(found, _modified(found))


def _helpers(folder: str) -> list[tuple[str, str]]:
    """(name, file) of the helper modules of the pipeline in ``folder`` imported now."""
    before = _IMPORTED_BEFORE[folder]
    found = []
    # copy() is one step under the GIL; iterating the live dict (even into a list) fails when
    # another thread imports meanwhile (a reward function still running on its thread)
    for name, module in sys.modules.copy().items():
        if name in before or name.startswith(_UNIQUE_PREFIX):
            continue
        path = getattr(module, "__file__", None)
        top = sys.modules.get(name.partition(".")[0])
        if path and top is not None and _found_in(top) == folder:
            found.append((name, path))
    return found


def _found_in(module: ModuleType) -> str | None:
    """The ``sys.path`` entry a top-level module or package was found in."""
    path = getattr(module, "__file__", None)
    if not path:
        return None
    where = Path(path)
    return str(where.parent.parent if where.name == "__init__.py" else where.parent)


def _modified(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return -1.0


@contextmanager
def _without_working_directory() -> Iterator[None]:
    """Import from installed packages only: ``python -c`` and ``python -m`` put the working
    directory first on sys.path, and a stray ``rewards.py`` there must not run as a reward."""
    here = {"", ".", os.getcwd()}
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if entry not in here]
    try:
        yield
    finally:
        sys.path[:] = saved


def _reward_file(name: str, base_dir: Path | None) -> Path:
    """The ``.py`` file ``name`` names: as given when absolute, else in the pipeline's folder."""
    path = Path(name).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        where = " (a relative path is read from the pipeline file's folder)" if not Path(name).is_absolute() else ""
        raise RewardError(f"reward file {path} not found{where}")
    return path


def _import_module(module_name: str, base_dir: Path | None) -> ModuleType:
    folder = Path(base_dir) if base_dir is not None else None
    if folder is not None:
        package = folder / module_name.split(".")[0]
        if (package / "__init__.py").is_file():
            # a package beside the pipeline file: imported as a package, so that its modules'
            # relative imports work
            with _from_folder(folder):
                return _import_package_module(module_name, package)
        candidate = folder / (module_name.replace(".", "/") + ".py")
        if candidate.is_file():
            with _from_folder(folder):
                return _load_file_module(module_name, candidate)
    try:
        with _without_working_directory():
            return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            where = f"in {base_dir} " if base_dir is not None else ""
            raise RewardError(
                f"module '{module_name}' not found {where}nor installed; put "
                f"{module_name.replace('.', '/')}.py next to the pipeline file, or install the "
                "package that provides it"
            ) from error
        raise RewardError(
            f"importing module '{module_name}' failed: {type(error).__name__}: {error}"
        ) from error
    except Exception as error:
        raise RewardError(
            f"importing module '{module_name}' failed: {type(error).__name__}: {error}"
        ) from error


def _import_package_module(module_name: str, package: Path) -> ModuleType:
    """``module_name`` of the package folder ``package`` beside the pipeline file, imported
    with that folder searched first; a package of the same name imported already (an installed
    or standard one) is a name clash, not a silent stand-in."""
    _refuse_clash(package)
    folder = str(package.parent.resolve())
    sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise RewardError(f"importing module '{module_name}' failed: {type(error).__name__}: {error}") from error
    finally:
        sys.path.remove(folder)
    _refuse_clash(package)
    return module


def _refuse_clash(package: Path) -> None:
    imported = sys.modules.get(package.name)
    if imported is None:
        return
    found = getattr(imported, "__file__", None)
    if found is None or not Path(found).resolve().is_relative_to(package.resolve()):
        where = f" ({Path(found).parent})" if found else ""
        raise RewardError(
            f"the package '{package.name}' next to the pipeline file has the name of one imported already{where}: "
            f"rename the folder {package}"
        )


def _get_attribute(module: ModuleType, module_name: str, qualname: str) -> Any:
    target: Any = module
    for part in qualname.split("."):
        if not hasattr(target, part):
            public = sorted(
                name for name, value in vars(target).items()
                if callable(value) and not name.startswith("_")
            )
            defined = f"; it defines: {', '.join(public)}" if public else ""
            raise RewardError(
                f"module '{module_name}' has no attribute '{qualname}'"
                f"{_did_you_mean(part, public)}{defined}"
            )
        target = getattr(target, part)
    return target


def resolve_reward(ref: str | PythonFunction, base_dir: Path | None = None) -> RewardFunction:
    """The reward function named by ``ref``.

    Args:
        ref: a registry name (``"math_answer"``, ``"digits"``, ...), ``"module:function"``
            (``function`` may be dotted, e.g. ``"mod:Grader.score"``), or a function passed
            by value (its pickled bytes).
        base_dir: the pipeline file's folder, searched for ``module.py`` before the installed
            packages; None to use installed packages only.

    Raises RewardError saying what was not found and what to do.
    """
    if isinstance(ref, PythonFunction):
        return _unpickle(ref)
    ref = ref.strip()
    known = ", ".join(sorted(REWARD_FUNCTIONS))
    if ":" not in ref:
        if ref in REWARD_FUNCTIONS:
            return REWARD_FUNCTIONS[ref]
        raise RewardError(
            f"unknown reward function '{ref}'{_did_you_mean(ref, list(REWARD_FUNCTIONS))}; "
            f"use one of {known}, or 'module:function' for your own function"
        )
    module_name, _, qualname = ref.partition(":")
    if not module_name or not qualname or ":" in qualname:
        raise RewardError(
            f"reward function '{ref}' is not of the form 'module:function' or 'path/file.py:function' "
            "(e.g. 'my_rewards:score' for a function score in my_rewards.py)"
        )
    if module_name == "__main__" and not hasattr(sys.modules.get("__main__"), qualname.split(".")[0]):
        raise RewardError(
            f"'{ref}' names a function of the script or notebook that built the pipeline in Python, which a "
            f"pipeline file cannot reach: move '{qualname}' into a module next to the file (my_rewards.py) and "
            f"write fn: my_rewards:{qualname}, or run the pipeline from that script"
        )
    if module_name.endswith(".py"):
        path = _reward_file(module_name, base_dir)
        with _from_folder(path.parent):
            module = _load_file_module(Path(module_name).stem, path)
    else:
        module = _import_module(module_name, base_dir)
    fn = _get_attribute(module, module_name, qualname)
    if not callable(fn):
        raise RewardError(
            f"'{qualname}' in module '{module_name}' is not callable (it is {type(fn).__name__}); "
            "point the score node at a function such as def reward(completions, **kwargs)"
        )
    result: RewardFunction = fn
    return result


def _unpickle(function: PythonFunction) -> RewardFunction:
    import cloudpickle  # type: ignore[import-untyped]

    try:
        loaded = cloudpickle.loads(function.payload)
    except Exception as error:  # noqa: BLE001 - e.g. a module the function needs is missing here
        raise RewardError(
            f"the reward function {function.name} cannot be unpickled in this process: "
            f"{type(error).__name__}: {error}; install the modules it uses on every worker"
        ) from error
    if function.file and isinstance(loaded, types.FunctionType):
        # cloudpickle names the code of a function it pickled by value "<dynamic-code>": its own
        # file again, so that an error in it says where (and the line shows where that file is);
        # so too its nested code (closures, comprehensions) and the functions of its module that
        # came with it (its helpers), whose globals it shares
        for value in [loaded, *loaded.__globals__.values()]:
            if isinstance(value, types.FunctionType) and value.__globals__ is loaded.__globals__ \
                    and value.__code__.co_filename.startswith("<"):
                value.__code__ = _named(value.__code__, function.file)
    result: RewardFunction = loaded
    return result


def _named(code: types.CodeType, file: str) -> types.CodeType:
    """``code`` and the code objects nested in it, named as defined in ``file``."""
    consts = tuple(_named(item, file) if isinstance(item, types.CodeType) else item for item in code.co_consts)
    return code.replace(co_filename=file, co_consts=consts)


class RewardCache:
    """Reward functions by reference, each resolved (imported or unpickled) once per process."""

    def __init__(self, base_dir: Path | None = None) -> None:
        self.base_dir = base_dir
        self._functions: dict[str, RewardFunction] = {}

    def get(self, ref: str | PythonFunction) -> RewardFunction:
        key = ref if isinstance(ref, str) else f"{ref.name}#{hash(ref.payload)}"
        if key not in self._functions:
            self._functions[key] = resolve_reward(ref, self.base_dir)
        return self._functions[key]
