"""A transformers model's decoder layers behind ``torch.compile`` for the log-prob passes.

In eager mode each decoder layer of a small model is dozens of kernels that each read and
write a whole activation (the norms in float32, the rotary halves, the gated activation);
on a GPU those, not the matrix products, take most of a forward and backward. Compiled,
they fuse into a few kernels and keep fewer tensors for the backward.

Only the layers are compiled (one compiled version serves every layer of the model: the
parameters are inputs of the graph, not constants), and only during the passes that ask for
it (:func:`compiled_layers`): generation through the model's own ``generate()`` and any other
use of the module stay eager. Packed attention (``flowrl.backends.packed_attention``) stays
outside the graphs: it runs per row, from bounds that change every pass.

A compiler failure is not a run failure: the pass is run again eagerly and the model stays
eager from then on (``CompiledLayers.failed``), with one warning.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, TypeVar

import torch

T = TypeVar("T")

ATTRIBUTE = "_flowrl_compiled_layers"


RECOMPILE_LIMIT = 64
"""Compiled versions the layers' shared code may have (torch's default is 8): the versions
multiply, by passes of one row against passes of more (a size of 1 is always exact), by the
lengths of packed passes (see :func:`_rows_and_lengths_dynamic`), by grad mode, by packed or padded
rows, by a padded pass with a mask or without one (rows padded only after their tokens) and,
for a model with adapters, by adapters on and off (its reference pass); past the limit torch
runs the layers eagerly without a word."""


class CompiledLayers:
    """The compiled call of each decoder layer of one model, made once."""

    def __init__(self, layers: list[torch.nn.Module], backend: str | Callable[..., Any] = "inductor") -> None:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.layers = layers
        self.calls: list[Callable[..., Any]] = [
            _rows_and_lengths_dynamic(torch.compile(layer._call_impl, dynamic=None, backend=backend))
            for layer in layers
        ]
        self.failed = False

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        # nn.Module.__call__ runs ``_compiled_call_impl`` when it is set (what
        # ``Module.compile()`` sets for good); here it is set for one block only.
        previous = [layer._compiled_call_impl for layer in self.layers]
        for layer, call in zip(self.layers, self.calls):
            layer._compiled_call_impl = call
        try:
            yield
        finally:
            for layer, before in zip(self.layers, previous):
                layer._compiled_call_impl = before


def _rows_and_lengths_dynamic(call: Callable[..., T]) -> Callable[..., T]:
    """``call`` (a compiled layer) with the rows and the sequence length of its inputs
    compiled as sizes that vary from the first call on.

    A run's passes change both every step (the completions' lengths, the rows a micro-batch
    of tokens holds). Left to torch, the first pass compiles for its exact sizes and the
    first pass of another length or row count compiles again (seconds each, in the third
    step of a GRPO run at 0.4B); marked, one version of a padded pass serves them all. A packed
    pass's layer breaks its graph at the attention (run outside the graphs), and the part after
    it receives the length as a plain number: it still compiles once more for a second length.
    The sizes marked are those of the hidden states' first two dimensions wherever another input
    has them: the rotary tables, the positions, a 4-D mask (whose last two are both the length);
    a feature dimension (the last of a 3-D input: the hidden size, the rotary width) is left as
    it is. Inputs of other layouts (a 3-D mask, a 4-D rotary table of several position kinds)
    would need their own rule; no supported model passes them."""

    def marked(*args: Any, **kwargs: Any) -> T:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            sizes = {hidden.shape[0], hidden.shape[1]}
            for value in [*args, *kwargs.values()]:
                for tensor in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        _mark(tensor, sizes)
        return call(*args, **kwargs)

    return marked


def _mark(tensor: torch.Tensor, sizes: set[int], dims: range | None = None) -> None:
    """Mark the dimensions of ``tensor`` (those in ``dims``; None: all but the last of a 3-D
    tensor, its feature dimension) whose size is one of ``sizes`` as varying."""
    import torch._dynamo

    if dims is None:
        dims = range(tensor.dim() - 1 if tensor.dim() == 3 else tensor.dim())
    for dim in dims:
        size = tensor.shape[dim]
        if size in sizes and size > 1:
            # "maybe": a size of 1, or one the graph needs exact, is specialised, not an error
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The decoder layers of a transformers causal LM (``base_model.layers``), else None."""
    backbone = getattr(module, "base_model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return None
    return list(layers)


def wanted(module: torch.nn.Module) -> bool:
    """Compile on CUDA only: on a CPU the compile time (a C++ build per graph) outweighs the
    gain for the small models that run there."""
    parameter = next(module.parameters(), None)
    return parameter is not None and parameter.device.type == "cuda"


def compiled_for(
    module: torch.nn.Module, force: bool = False, backend: str | Callable[..., Any] = "inductor"
) -> CompiledLayers | None:
    """The model's :class:`CompiledLayers` (made on first use); None where not wanted
    (``force``: on any device), for a model without decoder layers, or after a failure."""
    compiled: CompiledLayers | None = getattr(module, ATTRIBUTE, None)
    if compiled is None:
        if not (force or wanted(module)):
            return None
        layers = decoder_layers(module)
        if layers is None:
            return None
        compiled = CompiledLayers(layers, backend)
        # not a submodule: a plain attribute set past nn.Module's registration
        object.__setattr__(module, ATTRIBUTE, compiled)
    return None if compiled.failed else compiled


def run_compiled(module: torch.nn.Module, run: Callable[[], T], force: bool = False) -> T:
    """``run()`` (a pass of ``module``) with its decoder layers compiled where wanted; on a
    compiler failure, warn once and run it again eagerly."""
    compiled = compiled_for(module, force)
    if compiled is None:
        return run()
    try:
        with compiled.active():
            return run()
    except Exception as error:  # noqa: BLE001 - a compiler failure of any kind: stay eager
        if not _is_compiler_error(error):
            raise
        compiled.failed = True
        warnings.warn(
            f"torch.compile of the decoder layers failed ({type(error).__name__}: {str(error)[:300]}); "
            "log-prob passes of this model run eagerly",
            stacklevel=2,
        )
        return run()


class CompiledFunction:
    """A tensor function run through ``torch.compile`` when its first argument is on a device
    of ``device_types`` (CUDA: on a CPU the compile time outweighs the gain, as for the
    layers), plainly elsewhere; after a compiler failure it warns once and stays plain.

    For the small element-wise and reduction steps around a large matrix product (a chunk of
    logits cast to fp32, scaled, reduced), which eagerly are one pass over the chunk each and
    compiled are one or two. The rows vary; the other sizes (the vocabulary) are compiled as
    they come."""

    def __init__(self, function: Callable[..., T], what: str, device_types: tuple[str, ...] = ("cuda",),
                 backend: str | Callable[..., Any] = "inductor") -> None:
        self.function = function
        self.what = what
        self.device_types = device_types
        self.backend = backend
        self.compiled: Callable[..., T] | None = None
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        first = args[0]
        if self.failed or not (isinstance(first, torch.Tensor) and first.device.type in self.device_types):
            return self.function(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.function, dynamic=None, backend=self.backend)
        # The rows (the first dimension of the first argument, and of every argument of as
        # many rows) vary from the first call on: a pass's last chunk, and the chunks of a
        # pass of another length, reuse the version of the first.
        for value in args:
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                _mark(value, {first.shape[0]}, range(1))
        try:
            return self.compiled(*args)
        except Exception as error:  # noqa: BLE001 - a compiler failure of any kind: stay plain
            if not _is_compiler_error(error):
                raise
            self.failed = True
            warnings.warn(f"torch.compile of {self.what} failed ({type(error).__name__}: {str(error)[:300]}); "
                          "it runs uncompiled", stacklevel=2)
            return self.function(*args)


def _is_compiler_error(error: BaseException) -> bool:
    """Errors raised by dynamo or inductor (not by the model's own code or a lack of memory)."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    origin = type(error).__module__
    return origin.startswith(("torch._dynamo", "torch._inductor", "torch.fx", "torch._subclasses"))
