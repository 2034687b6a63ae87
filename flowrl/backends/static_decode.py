"""A decode engine with a static KV cache whose per-token step can run as one CUDA graph.

``model(...)`` per new token costs hundreds of small kernels launched from Python, each
through transformers' layers, masks and cache objects: on a GPU that overhead, not the
arithmetic, sets the speed (25 ms per token for a 0.4B model whatever the batch). This engine
runs the same decoder arithmetic from the model's own parameters (no copy: an optimizer step
is seen by the next generation) over preallocated buffers, so one decode step has fixed shapes
and fixed addresses (rotary, cache write and attention of a layer are one kernel,
``decode_attention``). On CUDA it is captured once into a CUDA graph and replayed per token:
the embedding lookup, every layer, the cache write, sampling, the eos bookkeeping and the
advance of positions all run on the GPU, and the host only asks every few steps whether every
row has finished.

Layout: prompts are left-padded, so cache column ``c`` holds every row's token ``c``; the
prefill writes columns ``0 .. P-1`` and decode step ``t`` writes column ``P + t``. Keys that
are padding are masked per row. Attention of one new query per row over a grouped KV head is
done by folding the query heads of a group into the query-length axis, so grouped-query
attention needs no copy of the cache.

A decode step's products have one row per sequence: the MLP's down projection, whose inner
dimension is several times its output, is cut into partial sums over slices of that dimension
(more tiles of work for the processors, each walking a slice) that the next layer's residual
addition sums (``_split_product``). With graphs, each product of a layer runs by cuBLAS or by a
Triton kernel, whichever was measured faster on the card for that shape and batch
(``decode_products``); the Triton kernel of the MLP's gated product also applies the gating.

Rows that finish early: the batch is compacted into a smaller captured graph once at most half
of the rows still run (the live rows' cache rows move to the front), so a long tail of a few
unfinished rows costs what a small batch costs.

Supported: decoder-only Llama-family models (``llama``, ``qwen2``: RMSNorm, rotary positions
with the default rope, SiLU-gated MLP, optional q/k/v biases). :func:`unsupported_reason`
says why another model is not; callers then use the plain loop in ``generation.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flowrl.backends.decode_attention import decode_attention, rotate
from flowrl.backends.decode_products import KINDS, SLICED, Launch, choose_launch, most_splits, triton_product
from flowrl.backends.generation import (
    GenerationOutput,
    check_arguments,
    decode_threads,
    is_stop,
    sample_with_noise,
    stop_ids,
)
from flowrl.backends.lora import has_adapters, is_adapted_layer, merged_weight
from flowrl.backends.shared_prompt import prompt_groups, repeats_of_previous_row

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
FINISHED_CHECK_EVERY = 16
"""Decode steps between host checks of "has every row finished?" (each check is a sync)."""
MIN_COMPACT_BATCH = 8
"""Below this many rows a smaller graph is not worth its capture."""
PROMPT_BUCKET = 32
"""With fixed shapes (captured graphs), prompt widths are rounded up to a multiple of this many
columns (see ``_widen_prompts``)."""
ATTENTION_WINDOW = 64
"""With fixed shapes, a decode step attends over the cache columns written so far rounded up to
a multiple of this many: early steps read a fraction of the cache, at one captured graph per
window. Without (a CPU), it attends over exactly the columns written."""


DEFAULT_GATE_UP_SPLITS = 1
DEFAULT_DOWN_SPLITS = 4
"""Parts of the inner dimension of a decode step's gate/up and down projections on a GPU
(``_split_product``). On an H100, 0.4B shape (hidden 896, MLP 4864), in four parts the down
projection took 6.1 us against 9.1 whole at 256 rows and 4.4 against 7.1 at 64, and the whole
decode step 1.53 against 1.58 ms at 256 rows; the gate/up product (inner 896, 9,728 outputs)
was slower cut (14.3 us in four parts against 9.6): ``benchmarks/results/decode_splits_h100.json``."""


def _splits(asked: int | None, inner: int, default: int, graphs: bool) -> int:
    """The parts a decode-step product's inner dimension of ``inner`` is cut into: as asked;
    else, with graphs (a GPU; on a CPU a product is not short of parallel work), the largest
    of ``default``, ``default // 2``, ... 1 that divides ``inner``; else 1. A count that does
    not divide ``inner`` (or below 1) is refused."""
    if asked is None:
        splits = default if graphs else 1
        while inner % splits:
            splits //= 2
        return splits
    if asked < 1 or inner % asked:
        raise ValueError(f"a product's inner dimension of {inner} cannot be cut into {asked} equal parts")
    return asked


def unsupported_reason(model: Any) -> str | None:
    """None when the engine can run ``model``; else a sentence saying why not."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    activation = getattr(config, "hidden_act", "silu")
    if activation != "silu":
        return f"activation {activation!r} is not silu"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default":
        return f"rope type {rope_type!r} is not the default rope"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention is not supported"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "the model does not have the model.layers / lm_head layout"
    # Read from the modules, whatever the config calls it (mlp_bias, o_proj_bias, or Llama's
    # attention_bias, which puts a bias on o_proj as well as on q/k/v).
    for layer in inner.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attention, "o_proj", None)] + [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if any(getattr(linear, "bias", None) is not None for linear in linears):
            return "biases on the MLP or the attention output are not supported"
    return None


class _Merged:
    """Stands in for the output projection or the down projection of a layer with adapters
    (``flowrl.backends.lora``): the weight merged with the adapter's product, at a fixed
    address, refreshed at the start of every generation like the stacked copies (an update
    changes the adapter in place)."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.weight = merged_weight(layer)
        self.bias = layer.get_base_layer().bias

    def refresh(self) -> None:
        self.weight.copy_(merged_weight(self.layer))


@dataclass(frozen=True)
class _Part:
    """Stands in for q, k, v, gate or up of a layer with adapters: its rows of the layer's
    stacked copy, which holds the merged weights (no copy of its own)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def _weight(linear: Any, adapted: bool) -> torch.Tensor:
    """A linear layer's weight as generation uses it: merged with its adapter, if it has one
    (``adapted``: the model has adapters; a model without never asks peft)."""
    return merged_weight(linear) if adapted and is_adapted_layer(linear) else linear.weight.detach()


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parameters, referenced (not copied) from the module. A linear
    layer here is anything with ``weight`` and ``bias``: the module's own, or for a model with
    adapters a stand-in (``_Merged``, ``_Part``)."""

    attn_norm: torch.nn.Module
    q: Any
    k: Any
    v: Any
    o: Any
    mlp_norm: torch.nn.Module
    gate: Any
    up: Any
    down: Any


def _tensor(value: object) -> torch.Tensor:
    """A module attribute that is a tensor (``Module.__getattr__`` is typed wider)."""
    assert isinstance(value, torch.Tensor)
    return value


def _number(value: object) -> float:
    """A module attribute that is a plain number (an RMSNorm's epsilon)."""
    assert isinstance(value, (int, float))
    return float(value)


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    # The same order of operations as transformers' LlamaRMSNorm, so fp32 results match.
    return _rms_norm_weights(x, _tensor(norm.weight), _number(norm.variance_epsilon))


def _attention_norm(x: torch.Tensor, pending: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first element-wise step for one new token per row: the previous layer's MLP
    output ``pending`` (or its partial sums) added to the residual stream ``x``, then the norm
    the q/k/v product reads. Returns the residual stream and the normed rows."""
    x = _residual(x, pending)
    return x, _rms_norm_weights(x, weight, eps)


def _mlp_norm(x: torch.Tensor, attention: torch.Tensor, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's second element-wise step: the output projection (or its partial sums) added
    to the residual stream, then the norm the MLP reads. The same arithmetic as
    :func:`_attention_norm`, in a function of its own so that each compiles its own versions
    (compiled versions are counted per function)."""
    x = _residual(x, attention)
    return x, _rms_norm_weights(x, weight, eps)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the stacked gate/up product [B, 2I], or from its [splits, B, 2I]
    partial sums (added in float32 first)."""
    if gate_up.dim() == 3:
        gate, up = gate_up.float().sum(0).chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gate_up.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _split_product(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """``x @ weight.T`` for [B, K] ``x`` and [N, K] ``weight`` as ``splits`` partial products
    over slices of K, [splits, B, N], one batched matrix product over strided views (no copy).

    A decode step's products have few rows (one per sequence): where K is long against N (the
    MLP's down projection), one product gives too few output tiles to keep the processors busy
    and each tile walks all of K; cut into slices, the tiles multiply and each walks a slice.
    The partial sums are added where their consumer reads them (a fused element-wise kernel)."""
    rows, inner = x.shape
    part = inner // splits
    left = x.view(rows, splits, part).transpose(0, 1)
    right = weight.reshape(weight.shape[0], splits, part).permute(1, 2, 0)  # a view of a contiguous weight
    return torch.bmm(left, right)


def _residual(x: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """``x + update``, rounded once to ``x``'s dtype as a plain addition is. Written with the
    float32 casts so that inductor does not fold the addition into the matrix product that
    made ``update`` (``addmm``): that form first copies ``x`` into the product's output, one
    more kernel per product, where the addition alone fuses into the norm that follows.
    Compiled, that norm reads the float32 sum (inductor keeps a kernel's intermediates in
    float32; only what it stores is rounded), so the last bits of a compiled step may differ
    from the eager one's, as the compiled norms' did before."""
    if update.dim() == x.dim() + 1:  # partial sums of a split product (``_split_product``)
        return (x.float() + update.float().sum(0)).to(x.dtype)
    return (x.float() + update.float()).to(x.dtype)


def _sample_tail(
    hidden: torch.Tensor, pending: torch.Tensor | None, norm: torch.Tensor, norm_eps: float, head: torch.Tensor,
    head_bias: torch.Tensor | None, temperature: torch.Tensor, noise: torch.Tensor | None, top_k: int, top_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's MLP output ``pending`` added (None: ``hidden`` is whole), final norm,
    output head and sampling of one token per row (compiled: a few kernels)."""
    if pending is not None:
        hidden = _residual(hidden, pending)
    logits = F.linear(_rms_norm_weights(hidden, norm, norm_eps), head, head_bias).float()
    return sample_with_noise(logits, temperature, top_p, top_k, noise)


def _rms_norm_weights(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class _Stacked:
    """A layer's q/k/v and gate/up weights side by side, at fixed addresses.

    They are copies, refreshed from the module at the start of every generation (an optimizer
    step changes the module's weights in place; the graphs read these copies).
    """

    def __init__(self, layer: _Layer, adapted: bool) -> None:
        self.layer = layer
        self.adapted = adapted
        qkv, biases, gate_up = self._parts()
        self.qkv_weight = torch.cat(qkv)
        self.qkv_bias = torch.cat(biases) if biases else None
        self.gate_up_weight = torch.cat(gate_up)

    def parts_of(self, layer: _Layer) -> _Layer:
        """``layer`` with q, k, v, gate and up read from these stacked copies (for a layer with
        adapters: the copies hold the merged weights)."""
        rows = [int(linear.weight.shape[0]) for linear in (layer.q, layer.k, layer.v)]
        weights = self.qkv_weight.split(rows)
        biases = self.qkv_bias.split(rows) if self.qkv_bias is not None else (None, None, None)
        gate, up = self.gate_up_weight.chunk(2)
        return dataclasses.replace(
            layer, q=_Part(weights[0], biases[0]), k=_Part(weights[1], biases[1]), v=_Part(weights[2], biases[2]),
            gate=_Part(gate, None), up=_Part(up, None))

    def refresh(self) -> None:
        targets = (self.qkv_weight, self.qkv_bias, self.gate_up_weight)
        for target, parts in zip(targets, self._parts()):
            if target is not None:
                torch.cat(parts, out=target)

    def _parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The module tensors each stacked copy is made of (no q/k/v biases: an empty list)."""
        layer = self.layer
        qkv = (layer.q, layer.k, layer.v)
        biases = [linear.bias.detach() for linear in qkv] if layer.q.bias is not None else []
        adapted = self.adapted
        return ([_weight(linear, adapted) for linear in qkv], biases,
                [_weight(layer.gate, adapted), _weight(layer.up, adapted)])


class _Buffers:
    """Every tensor a decode step reads or writes, allocated once for the largest batch."""

    def __init__(self, batch: int, columns: int, new_tokens: int, layers: int, kv_heads: int,
                 head_dim: int, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, down_splits: int = 1) -> None:
        def full(shape: tuple[int, ...], value: Any, kind: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=kind, device=device)

        self.keys = full((layers, batch, kv_heads, columns, head_dim), 0, dtype)
        self.values = full((layers, batch, kv_heads, columns, head_dim), 0, dtype)
        self.key_valid = full((batch, columns), False, torch.bool)
        self.tokens = full((batch,), 0, torch.long)
        self.positions = full((batch,), 0, torch.long)
        self.unfinished = full((batch,), True, torch.bool)
        self.column = full((1,), 0, torch.long)
        """The cache column this step writes (P + t)."""
        self.out_column = full((1,), 0, torch.long)
        """The output column this step writes (t)."""
        self.completion_ids = full((batch, new_tokens), 0, torch.long)
        self.completion_mask = full((batch, new_tokens), 0, torch.long)
        self.logprobs = full((batch, new_tokens), 0.0, torch.float32)
        self.temperature = full((1,), 1.0, torch.float32)
        self.zeros = full((down_splits * batch * hidden_size,), 0, dtype)
        """What the first layer's norm adds to the embeddings (:meth:`first_pending`); room for
        ``down_splits`` partial sums, the most a down projection may be cut into."""
        self.noise = full((batch, vocab_size), 1.0, torch.float32)
        """Exp(1) draws for sampling, refilled every step from the generator."""
        self.down_splits, self.hidden_size = down_splits, hidden_size

    def first_pending(self, batch: int, splits: int | None = None) -> torch.Tensor:
        """Zeros shaped as the later layers' MLP outputs for ``batch`` rows ([splits, batch,
        hidden] partial sums of a down projection cut into ``splits`` (default: the buffers'
        ``down_splits``), else [batch, hidden]) and, like them, contiguous: the compiled norm
        is specialised on shapes and strides, and a strided slice of a larger buffer would
        compile it once more for every batch size."""
        splits = self.down_splits if splits is None else splits
        size = splits * batch * self.hidden_size
        if size > self.zeros.numel():
            raise ValueError(f"the buffers hold zeros for {self.down_splits} partial sums, not {splits}")
        if splits > 1:
            return self.zeros[:size].view(splits, batch, self.hidden_size)
        return self.zeros[:size].view(batch, self.hidden_size)


@dataclass(frozen=True)
class _Sampling:
    """The sampling settings that change a captured graph's kernels."""

    greedy: bool
    top_k: int
    top_p: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int


class StaticDecoder:
    """Generation for one model over buffers sized for ``max_batch`` rows of ``max_columns``.

    Build one per model (``decoder_for`` caches it on the module); it re-captures its graphs
    when the parameters move to new storage (a migration that replaced them) or the sampling
    settings change, and reallocates when a call needs more rows or columns.
    """

    def __init__(self, model: Any, use_graphs: bool | None = None, compile_layers: bool = True,
                 fixed_shapes: bool | None = None, gate_up_splits: int | None = None,
                 down_splits: int | None = None, triton_products: bool = True,
                 launches: Mapping[str, Launch | None] | None = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the static decoder cannot run this model: {reason}")
        self.model = model
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        # A model with adapters: the output and down projections get merged copies; q, k, v,
        # gate and up are merged into the stacked copies the decode step reads anyway, and the
        # prefill reads them there too.
        adapted = has_adapters(model)

        def merged(linear: Any) -> Any:
            return _Merged(linear) if adapted and is_adapted_layer(linear) else linear

        with torch.no_grad():
            self.layers = [
                _Layer(
                    attn_norm=layer.input_layernorm,
                    q=layer.self_attn.q_proj, k=layer.self_attn.k_proj,
                    v=layer.self_attn.v_proj, o=merged(layer.self_attn.o_proj),
                    mlp_norm=layer.post_attention_layernorm,
                    gate=layer.mlp.gate_proj, up=layer.mlp.up_proj, down=merged(layer.mlp.down_proj),
                )
                for layer in inner.layers
            ]
            self._stacked = [_Stacked(layer, adapted) for layer in self.layers]
        if adapted:
            self.layers = [stacked.parts_of(layer) for layer, stacked in zip(self.layers, self._stacked)]
        self._merged = [linear for layer in self.layers for linear in (layer.o, layer.down)
                        if isinstance(linear, _Merged)]
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.scaling = self.head_dim ** -0.5
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.fixed_shapes = self.use_graphs if fixed_shapes is None else fixed_shapes
        """Round prompt widths and attention windows up so that few shapes (few captured graphs)
        serve every call; without graphs the columns rounded up would only cost arithmetic: on
        2 CPU cores the plain widths made builtin:small-llama's 32 x 32 tokens 16 % faster."""
        hidden, intermediate = int(self.embed.weight.shape[1]), int(self.layers[0].down.weight.shape[1])
        self.gate_up_splits = _splits(gate_up_splits, hidden, DEFAULT_GATE_UP_SPLITS, self.use_graphs)
        self.down_splits = _splits(down_splits, intermediate, DEFAULT_DOWN_SPLITS, self.use_graphs)
        self.triton_products = self.use_graphs and triton_products
        """Measure each product of a decode step by cuBLAS against the Triton launches
        (``decode_products``) for every batch size captured, and run the faster."""
        self._launches: dict[int, dict[str, Launch | None]] = {}
        """The launch each product runs with, by batch size (None: cuBLAS)."""
        self._check_launches(launches or {})
        self._fixed_launches = None if launches is None else {kind: launches.get(kind) for kind in KINDS}
        """``launches``: the launch of each product (``decode_products.KINDS``; one left out:
        cuBLAS) at every batch size, instead of measuring (with graphs: elsewhere every product
        is plain torch)."""
        self._check_every = FINISHED_CHECK_EVERY if self.use_graphs else 1
        """Without graphs, asking whether every row finished costs no device sync."""
        self._window_step = ATTENTION_WINDOW if self.fixed_shapes else 1
        self._compiled = self.use_graphs and compile_layers
        self._set_kernels(self._compiled)
        self._buffers: _Buffers | None = None
        self._shape: tuple[int, int, int] = (0, 0, 0)
        self._graphs: dict[tuple[int, int], Any] = {}
        self._graph_key: tuple[Any, ...] | None = None
        self._graph_generator: torch.Generator | None = None
        self._pool: Any = None
        self._stream: Any = None
        """The side stream every warm-up and capture runs on (made at the first capture)."""
        self._cos = self._sin = torch.empty(0)

    def _check_launches(self, launches: Mapping[str, Launch | None]) -> None:
        """Refuse fixed launches for products the decoder does not have, that cut a product
        whose consumer reads it whole, or whose slices are not whole blocks of the product's
        inner dimension."""
        hidden = int(self.embed.weight.shape[1])
        inner = {"qkv": hidden, "o": self.num_heads * self.head_dim, "gated": hidden,
                 "down": int(self.layers[0].down.weight.shape[1])}
        for kind, launch in launches.items():
            if kind not in KINDS or (launch is not None and launch.splits > 1 and kind not in SLICED):
                raise ValueError(f"no launch {launch} for a product {kind!r}: the products are {', '.join(KINDS)}, "
                                 f"and only {' and '.join(SLICED)} may be cut into slices")
            if launch is not None and not launch.fits(inner[kind]):
                raise ValueError(f"launch {launch} does not cut the {kind} product's inner dimension of "
                                 f"{inner[kind]} into whole blocks")

    def _set_kernels(self, compiled: bool) -> None:
        """The element-wise steps of a layer (the residual additions with the norms, the
        gating) and the sampling tail, compiled or plain."""
        self._attention_norm: Any = _attention_norm
        self._mlp_norm: Any = _mlp_norm
        self._silu_mul: Any = _silu_mul
        self._tail: Any = _sample_tail
        if compiled:
            # Inductor fuses each residual addition with the norm after it, and the gating,
            # into one kernel each (replay time is per kernel); one compiled version serves
            # every layer. The products run between them (cuBLAS or Triton, ``_product``);
            # rotary, cache write and attention are one kernel (``decode_attention``) over a
            # window of columns that grows with the step, and so does not multiply the
            # compiled versions.
            self._attention_norm = torch.compile(_attention_norm, dynamic=False, fullgraph=True)
            self._mlp_norm = torch.compile(_mlp_norm, dynamic=False, fullgraph=True)
            self._silu_mul = torch.compile(_silu_mul, dynamic=False, fullgraph=True)
            self._tail = torch.compile(_sample_tail, dynamic=False, fullgraph=True)

    # -- the decoder arithmetic ------------------------------------------------------------

    def _rope_tables(self, columns: int) -> None:
        positions = torch.arange(columns, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(device=self.device, dtype=torch.float32)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos = (angles.cos() * self.rope_scale).to(self.dtype)
        self._sin = (angles.sin() * self.rope_scale).to(self.dtype)

    def _attend_prefill(self, layer_index: int, layer: _Layer, h: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        assert buffers is not None
        batch, length, _ = h.shape
        q = F.linear(h, layer.q.weight, layer.q.bias).view(batch, length, self.num_heads, self.head_dim)
        k = F.linear(h, layer.k.weight, layer.k.bias).view(batch, length, self.num_kv_heads, self.head_dim)
        v = F.linear(h, layer.v.weight, layer.v.bias).view(batch, length, self.num_kv_heads, self.head_dim)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        buffers.keys[layer_index, :batch, :, :length] = k
        buffers.values[layer_index, :batch, :, :length] = v
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        return F.linear(out.transpose(1, 2).reshape(batch, length, -1), layer.o.weight, layer.o.bias)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate = F.linear(h, layer.gate.weight, layer.gate.bias)
        up = F.linear(h, layer.up.weight, layer.up.bias)
        return F.linear(F.silu(gate) * up, layer.down.weight, layer.down.bias)

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the prompts, fill cache columns 0..P-1; return the last column's hidden states.

        A prompt repeated in consecutive rows (a GRPO group's samples) runs once; its cache
        rows and hidden state are copied to the repeats."""
        repeat = repeats_of_previous_row(input_ids, attention_mask)
        if not bool(repeat.any()):
            return self._prefill_rows(input_ids, attention_mask)
        first, owner = prompt_groups(repeat)  # owner: row -> its prompt's index in ``first``
        hidden = self._prefill_rows(input_ids[first], attention_mask[first])
        b = self._buffers
        assert b is not None
        length, rows = input_ids.shape[1], owner.shape[0]
        for cache in (b.keys, b.values):
            for layer in range(cache.shape[0]):  # layer by layer: the gathered copy is one layer's
                cache[layer, :rows, :, :length] = cache[layer, owner, :, :length]
        return hidden.index_select(0, owner)

    def _prefill_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        valid = attention_mask.bool()
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
        # A padding query sees nothing under causal & valid; letting it see itself keeps its
        # softmax finite. Its output is never used and its key is masked for everyone else.
        mask = (causal[None] & valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=self.device)[None]
        mask = mask[:, None]
        x = self.embed(input_ids)
        for index, layer in enumerate(self.layers):
            x = x + self._attend_prefill(index, layer, _rms_norm(x, layer.attn_norm), cos, sin, mask)
            x = x + self._mlp(layer, _rms_norm(x, layer.mlp_norm))
        return x[:, -1].contiguous()

    def _decode_step(self, batch: int, window: int, sampling: _Sampling, generator: torch.Generator | None) -> None:
        """One token for rows ``:batch``, attending over cache columns ``:window``: everything
        reads and writes the fixed buffers."""
        b = self._buffers
        assert b is not None
        b.key_valid[:batch].index_fill_(1, b.column, True)
        key_valid = b.key_valid[:batch, :window]
        positions = b.positions[:batch]
        cos = self._cos.index_select(0, positions)
        sin = self._sin.index_select(0, positions)
        x = self.embed.weight.index_select(0, b.tokens[:batch])
        launches = self._launches.get(batch) or dict.fromkeys(KINDS)
        down = launches["down"]
        # the MLP output the next norm adds to x: none before the first layer
        pending = b.first_pending(batch, down.splits if down is not None else self.down_splits)
        for index, (layer, stacked) in enumerate(zip(self.layers, self._stacked)):
            keys, values = b.keys[index, :batch], b.values[index, :batch]
            x, normed = self._attention_norm(x, pending, layer.attn_norm.weight,
                                             _number(layer.attn_norm.variance_epsilon))
            qkv = self._product("qkv", normed, stacked.qkv_weight, stacked.qkv_bias, launches["qkv"])
            attended = decode_attention(qkv, cos, sin, keys[:, :, :window], values[:, :, :window], b.column,
                                        key_valid, self.scaling, all_written=self._window_step == 1)
            attention = self._product("o", attended.reshape(batch, -1), layer.o.weight, None, launches["o"])
            x, normed = self._mlp_norm(x, attention, layer.mlp_norm.weight, _number(layer.mlp_norm.variance_epsilon))
            gated = self._product("gated", normed, stacked.gate_up_weight, None, launches["gated"])
            pending = self._product("down", gated, layer.down.weight, None, down)
        self._sample_into(x, batch, sampling, generator, pending=pending)
        b.positions[:batch] += 1
        b.column += 1

    def _product(self, kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 launch: Launch | None) -> torch.Tensor:
        """Product ``kind`` of a decode step (``decode_products.KINDS``) for input ``x``: by
        the Triton ``launch``, or by cuBLAS (None), the gate/up and down products cut into
        ``gate_up_splits`` / ``down_splits`` slices. The gated product returns silu(gate) * up;
        the output and down projections may return partial sums, which the next norm adds."""
        if launch is not None:
            return triton_product(x, weight, bias, launch, gated=kind == "gated")
        if kind == "gated":
            splits = self.gate_up_splits
            return self._silu_mul(_split_product(x, weight, splits) if splits > 1 else F.linear(x, weight))
        if kind == "down" and self.down_splits > 1:
            return _split_product(x, weight, self.down_splits)
        return F.linear(x, weight, bias)

    def _choose_launches(self, batch: int, stream: Any) -> None:
        """Measure, for ``batch`` rows, each product of a decode step by cuBLAS against the Triton
        launches that fit it (``decode_products.choose_launch``, on the decoder's ``stream``),
        once per batch size. A measurement that fails leaves every product to cuBLAS, with a
        warning: the choice may only make a step faster, never stop it."""
        if batch in self._launches:
            return
        if self._fixed_launches is not None or not self.triton_products:
            self._launches[batch] = dict(self._fixed_launches or dict.fromkeys(KINDS))
            return
        try:
            self._launches[batch] = self._measured_launches(batch, stream)
        except Exception as error:  # noqa: BLE001 - whatever failed, cuBLAS runs as without the choice
            warnings.warn(f"measuring the decode step's products at {batch} rows failed ({type(error).__name__}: "
                          f"{str(error)[:300]}); they run by cuBLAS", stacklevel=2)
            self._launches[batch] = dict.fromkeys(KINDS)

    def _measured_launches(self, batch: int, stream: Any) -> dict[str, Launch | None]:
        stacked = self._stacked
        none: list[torch.Tensor | None] = [None] * len(stacked)
        operands: dict[str, tuple[list[torch.Tensor], list[torch.Tensor | None]]] = {
            "qkv": ([s.qkv_weight for s in stacked], [s.qkv_bias for s in stacked]),
            "o": ([layer.o.weight for layer in self.layers], none),
            "gated": ([s.gate_up_weight for s in stacked], none),
            "down": ([layer.down.weight for layer in self.layers], none),
        }
        chosen: dict[str, Launch | None] = {}
        # inputs from a generator of their own: the measurement leaves the global one as it was
        generator = torch.Generator(self.device).manual_seed(0)
        # what the cuBLAS candidates run: their slices, and the gating compiled or not
        variant = (self.gate_up_splits, self.down_splits, self._compiled)
        for kind, (weights, biases) in operands.items():
            x = torch.randn((batch, int(weights[0].shape[1])), dtype=self.dtype, device=self.device,
                            generator=generator)

            def plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      kind: str = kind) -> torch.Tensor:
                return self._product(kind, x, weight, bias, None)

            chosen[kind] = choose_launch(kind, x, weights, biases, plain, variant, stream)
        return chosen

    def _sample_into(self, hidden: torch.Tensor, batch: int, sampling: _Sampling,
                     generator: torch.Generator | None, compiled: bool = True,
                     pending: torch.Tensor | None = None) -> None:
        """Sample from the last hidden states (plus the last layer's MLP output ``pending``)
        and write token, mask and log-prob at the output column; ``compiled``: through the
        compiled tail (inside a captured step, where a compiler failure falls back to plain
        code) or the plain one."""
        b = self._buffers
        assert b is not None
        noise = None
        if not sampling.greedy:
            noise = b.noise[:batch].exponential_(generator=generator)
        tail = self._tail if compiled else _sample_tail
        tokens, logprobs = tail(
            hidden, pending, self.final_norm.weight, _number(self.final_norm.variance_epsilon),
            self.lm_head.weight, getattr(self.lm_head, "bias", None), b.temperature, noise,
            sampling.top_k, sampling.top_p,
        )
        unfinished = b.unfinished[:batch]
        tokens = torch.where(unfinished, tokens, sampling.pad_token_id)
        b.completion_ids[:batch].index_copy_(1, b.out_column, tokens[:, None])
        b.completion_mask[:batch].index_copy_(1, b.out_column, unfinished.long()[:, None])
        b.logprobs[:batch].index_copy_(1, b.out_column, logprobs.masked_fill(~unfinished, 0.0)[:, None])
        unfinished &= ~is_stop(tokens, sampling.eos_token_ids)
        b.tokens[:batch] = tokens
        b.out_column += 1

    # -- buffers and graphs ---------------------------------------------------------------

    def _widen_prompts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                       pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """With fixed shapes, left-pad the prompts to a width of a multiple of ``PROMPT_BUCKET`` columns, or to the
        width the buffers already have when that is wider: batches whose longest prompt differs
        a little then reuse the same cache and captured graphs (a new width means new buffers,
        a new compile and new captures). Masked columns change no number."""
        width = input_ids.shape[1]
        if not self.fixed_shapes:
            return input_ids, attention_mask  # new buffers for a new width cost less than padding
        target = -(-width // PROMPT_BUCKET) * PROMPT_BUCKET
        have_batch, have_columns, have_new = self._shape
        if have_new == new_tokens and width <= have_columns - new_tokens and input_ids.shape[0] <= have_batch:
            target = max(target, have_columns - new_tokens)
        if target == width:
            return input_ids, attention_mask
        pad = target - width
        return (F.pad(input_ids, (pad, 0), value=pad_token_id), F.pad(attention_mask, (pad, 0), value=0))

    def _ensure_buffers(self, batch: int, columns: int, new_tokens: int) -> None:
        have_batch, have_columns, have_new = self._shape
        if batch <= have_batch and columns == have_columns and new_tokens == have_new:
            return
        self._drop_graphs()
        self._buffers = None  # free the old cache before allocating the new one
        shape = (max(batch, have_batch) if columns == have_columns and new_tokens == have_new else batch,
                 columns, new_tokens)
        fixed = (self._fixed_launches or {}).get("down")
        splits = max(self.down_splits, most_splits() if self.triton_products else 1, fixed.splits if fixed else 1)
        self._buffers = _Buffers(shape[0], columns, new_tokens, len(self.layers), self.num_kv_heads,
                                 self.head_dim, int(self.embed.weight.shape[1]), int(self.lm_head.weight.shape[0]),
                                 self.dtype, self.device, splits)
        self._rope_tables(columns)
        self._shape = shape

    def _parameter_key(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _forget_stale_graphs(self, sampling: _Sampling, generator: torch.Generator | None) -> None:
        """Drop the captured graphs when parameters moved, or sampling or generator changed."""
        # The generator itself, not its id: a new generator may reuse a freed one's address,
        # and a graph replays with the generator registered at its capture.
        key = (self._parameter_key(), sampling)
        if key != self._graph_key or generator is not self._graph_generator:
            self._drop_graphs()
            self._graph_key = key
            self._graph_generator = generator

    def _drop_graphs(self) -> None:
        """Forget every captured graph, and with them their memory pool: a pool whose graphs
        are all gone cannot take a new capture."""
        self._graphs.clear()
        self._pool = None

    def _graph_for(self, batch: int, window: int, sampling: _Sampling, generator: torch.Generator | None) -> Any:
        if (batch, window) not in self._graphs:
            self._graphs[batch, window] = self._capture(batch, window, sampling, generator)
        return self._graphs[batch, window]

    def _capture(self, batch: int, window: int, sampling: _Sampling, generator: torch.Generator | None) -> Any:
        b = self._buffers
        assert b is not None
        saved = [t.clone() for t in (b.column, b.out_column, b.positions, b.tokens, b.unfinished)]
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        # Warm-up on a side stream (cuBLAS and allocator set-up must not be captured); the
        # steps it runs write into column slots that the real steps overwrite afterwards.
        # One stream for every warm-up and capture: cuBLAS keeps a workspace per stream that
        # runs a matrix product (32 MiB each on a Hopper card), so a new stream per capture
        # would hold one more workspace per captured window.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._choose_launches(batch, stream)
            try:
                self._decode_step(batch, window, sampling, generator)
            except Exception as error:  # noqa: BLE001 - any compiler failure: run uncompiled
                if not self._compiled:
                    raise
                warnings.warn(f"torch.compile of the decode step failed ({type(error).__name__}: "
                              f"{error}); the decode graph runs it uncompiled", stacklevel=2)
                self._compiled = False
                self._set_kernels(False)
                self._decode_step(batch, window, sampling, generator)
        torch.cuda.current_stream().wait_stream(stream)
        for tensor, value in zip((b.column, b.out_column, b.positions, b.tokens, b.unfinished), saved):
            tensor.copy_(value)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # One memory pool for every graph: they replay one at a time, so their scratch
        # tensors can share addresses instead of each graph keeping its own.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._decode_step(batch, window, sampling, generator)
        # Capturing does not run the step: the buffers still hold the values from before it.
        return graph

    # -- the public call ------------------------------------------------------------------

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> GenerationOutput:
        """Same contract as :func:`flowrl.backends.generation.generate_tokens`."""
        check_arguments(input_ids, attention_mask, max_new_tokens, temperature, top_p, top_k)
        with torch.inference_mode(), decode_threads(self.model, input_ids.shape[0], self.device):
            return self._generate(input_ids.to(self.device), attention_mask.to(self.device).long(),
                                  max_new_tokens, _Sampling(greedy, top_k, top_p, stop_ids(eos_token_id), pad_token_id),
                                  temperature, generator)

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                  sampling: _Sampling, temperature: float,
                  generator: torch.Generator | None) -> GenerationOutput:
        input_ids, attention_mask = self._widen_prompts(input_ids, attention_mask, max_new_tokens, sampling.pad_token_id)
        batch, prompt_length = input_ids.shape
        for merged in self._merged:
            merged.refresh()
        for stacked in self._stacked:
            stacked.refresh()
        columns = prompt_length + max_new_tokens
        self._ensure_buffers(batch, columns, max_new_tokens)
        b = self._buffers
        assert b is not None
        b.key_valid.zero_()
        b.key_valid[:batch, :prompt_length] = attention_mask.bool()
        b.unfinished.fill_(True)
        b.completion_ids.fill_(sampling.pad_token_id)
        b.completion_mask.zero_()
        b.logprobs.zero_()
        b.temperature.fill_(temperature)
        b.out_column.zero_()
        b.column.fill_(prompt_length)
        b.positions[:batch] = attention_mask.sum(dim=1)
        # Once per call, outside any captured graph: the plain tail (a compiled one here would
        # compile per batch size where no fallback catches a compiler failure).
        self._sample_into(self._prefill(input_ids, attention_mask), batch, sampling, generator, compiled=False)

        if self.use_graphs:
            self._forget_stale_graphs(sampling, generator)
        result = _Result(batch, max_new_tokens, sampling.pad_token_id, self.device)
        rows = torch.arange(batch, device=self.device)
        """The original row of each live buffer row (compaction moves live rows to the front)."""
        live = batch
        for produced in range(1, max_new_tokens):
            if produced % self._check_every == 0:
                running = int(b.unfinished[:live].sum())
                if running == 0:
                    break
                # Batch sizes are powers of two (of the first size): few graphs to capture.
                keep = max(MIN_COMPACT_BATCH, 1 << (running - 1).bit_length())
                if keep * 2 <= live:
                    live, rows = self._compact(result, live, rows, keep)
            # Columns written so far: the prompt and the tokens fed back (this step writes one).
            step = self._window_step
            window = min(-(-(prompt_length + produced) // step) * step, columns)
            if self.use_graphs:
                self._graph_for(live, window, sampling, generator).replay()
            else:
                self._decode_step(live, window, sampling, generator)
        result.take(b, rows, live)
        return result.output()

    def _compact(self, result: "_Result", live: int, rows: torch.Tensor,
                 keep: int) -> tuple[int, torch.Tensor]:
        """Move the running rows to the front (padded with finished ones up to ``keep``).

        Every row's outputs so far go to ``result`` first: rows dropped here are finished,
        so what they hold now is final.
        """
        b = self._buffers
        assert b is not None
        result.take(b, rows, live)
        order = torch.argsort((~b.unfinished[:live]).to(torch.int8), stable=True)[:keep]
        for tensor in (b.keys, b.values):
            tensor[:, :keep] = tensor[:, order]
        for tensor in (b.key_valid, b.tokens, b.positions, b.unfinished, b.completion_ids,
                       b.completion_mask, b.logprobs):
            tensor[:keep] = tensor[order]
        return keep, rows[order]


class _Result:
    """The outputs in the caller's row order, filled from the buffers' live rows."""

    def __init__(self, batch: int, new_tokens: int, pad_token_id: int, device: torch.device) -> None:
        self.ids = torch.full((batch, new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, new_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, new_tokens, dtype=torch.float32, device=device)

    def take(self, buffers: _Buffers, rows: torch.Tensor, live: int) -> None:
        self.ids[rows] = buffers.completion_ids[:live]
        self.mask[rows] = buffers.completion_mask[:live]
        self.logprobs[rows] = buffers.logprobs[:live]

    def output(self) -> GenerationOutput:
        # The decode steps that mattered: up to the step where the last row finished (the
        # loop checks only every few steps, so it may have run a few steps of padding more).
        steps = max(int(self.mask.sum(dim=1).max()), 1)
        return GenerationOutput(
            completion_ids=self.ids[:, :steps],
            completion_mask=self.mask[:, :steps],
            num_decode_steps=steps,
            sampled_logprobs=self.logprobs[:, :steps],
        )


DECODER_ATTRIBUTE = "_flowrl_static_decoder"
"""Where a model instance keeps its decoder."""


def decoder_for(model: Any) -> StaticDecoder | None:
    """The model's cached decoder, built on first use; None when the model is unsupported."""
    decoder = getattr(model, DECODER_ATTRIBUTE, None)
    weight = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    stale = decoder is None or decoder.model is not model or (
        weight is not None and (weight.device != decoder.device or weight.dtype != decoder.dtype))
    if stale:
        if unsupported_reason(model) is not None:
            return None
        decoder = StaticDecoder(model)
        # Stored outside the module's registries so it never enters a state_dict or .to().
        object.__setattr__(model, DECODER_ATTRIBUTE, decoder)
    return decoder
