"""The analytic cost model: FLOPs, bytes and memory of each node from shapes and work.

Everything here is arithmetic on plain numbers, so it can be checked by hand (the tests
do) and it runs where the hardware does not exist. Notation used below:

    P  parameters          M  parameters a token multiplies (all but the input embedding)
    L  layers              h  hidden size          V  output size (vocab; 1 for a scalar head)
    H  attention heads     kv key/value width per token and layer = kv_heads * (h / H)
    b  bytes per parameter (fp32 4, bf16/fp16 2)   s  sequence length   T  tokens in a pass

Forward FLOPs of T tokens in sequences of length s:  2*M*T + 4*L*h*s*T
(the dense matmuls, plus QK^T and AV over the whole sequence: eager attention is dense).
A backward pass costs twice the forward; gradient checkpointing adds one more forward.

Generation is a prefill (one forward over the prompts, compute-bound) plus one decode step
per new token. A decode step reads every weight and the KV cache once, so on a GPU it is
bound by memory bandwidth: step = max(bytes / bandwidth, FLOPs / peak).

Memory (bytes):
    weights   P*b;  gradients P*b;  AdamW moments 2*P*b for an fp32 model; a bf16/fp16
              model trains through fp32 masters (``flowrl.roles.master_weights``): a master
              and two moments in fp32, 12*P beside its 16-bit weights and gradients (its
              step's fp32 copies of the gradients, in chunks of 256 MB, come after the
              passes' activations are gone and are not counted)
    KV cache  sequences * (prompt + response) * 2 * L * kv * b
    training activations per micro-batch, per token and layer, with SDPA attention (no
              s*s scores are kept):  b*(8h + 4I + 2kv), plus 4h at 16 bits (RMSNorm
              computes in fp32). Counted with saved-tensor hooks on a Qwen2 layer (57,408
              bytes per token at h=896, I=4864, kv=128 in bf16; 107,584 in fp32; the
              formula gives 57,344 and 107,520). Compiled layers (GPU passes) keep
              b*(6h + 3I + 2kv): the compiler's partitioner recomputes the norms and the
              gated activation in the backward (fitted on four Qwen2 shapes with that
              partitioner, within 0.5 %). With checkpointing: L*T*h*b plus one layer's
    output head  a causal LM's log-probs run through the fused head, which holds one
              chunk of FUSED_CHUNK_ELEMENTS logits at a time (16-bit logits, fp32 scaled
              copy and, training, their fp32 gradient) and, training, the fp32 gradient of
              the hidden states its backward sums over its chunks of columns (T*h*4); a
              model that transforms its logits
              (``ModelShape.plain_logits`` False) holds every token's; a scalar head holds T*4
    adapters (LoRA) of A parameters (in the model's dtype): 16*A (weights, gradients and
              the optimizer's state, ``training_state_bytes``) instead of the model's gradients
              and optimizer state; the frozen layers' backward
              computes input gradients only, one forward's FLOPs instead of two
    sharded training over N devices (FSDP2) keeps the whole weights plus 1/N of the
              trained parameters, their gradients and the optimizer's state, and
              gathers one layer and the outer unit at a time (``sharded_training_bytes``)
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from flowrl.backends.catalog import BUILTIN_MODELS
from flowrl.backends.locations import read_config
from flowrl.backends.logits import transforms_logits
from flowrl.errors import ModelLoadError, PlacementError

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per parameter of each dtype a model may declare."""

@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that its costs depend on."""

    num_layers: int
    """Decoder layers (L)."""
    hidden_size: int
    """Width of the residual stream (h)."""
    num_heads: int
    """Attention heads (H)."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    intermediate_size: int
    """Width of the gated MLP's hidden layer."""
    vocab_size: int
    """Tokenizer vocabulary (rows of the input embedding)."""
    tie_embeddings: bool = False
    """The output head reuses the input embedding (no separate parameters)."""
    plain_logits: bool = True
    """The logits are the output head's plain product, so log-probs go through the fused head
    (``flowrl.backends.logits``); else the model's forward makes every token's logits."""

    @property
    def kv_width(self) -> int:
        """Key (or value) numbers per token and layer: kv_heads * head size."""
        return self.num_kv_heads * (self.hidden_size // self.num_heads)

    def layer_parameters(self) -> int:
        """One decoder layer: q, o (h*h each), k, v (h*kv each), gated MLP 3*h*I, 2 norms."""
        h = self.hidden_size
        attention = 2 * h * h + 2 * h * self.kv_width
        return attention + 3 * h * self.intermediate_size + 2 * h

    def output_size(self, kind: str) -> int:
        """V: the vocabulary for a policy, 1 for a value or reward model's scalar head."""
        return self.vocab_size if kind == "policy" else 1

    def head_parameters(self, kind: str) -> int:
        if kind == "policy" and self.tie_embeddings:
            return 0
        return self.hidden_size * self.output_size(kind)

    def num_parameters(self, kind: str = "policy") -> int:
        """P: embedding + layers + final norm + output head."""
        h = self.hidden_size
        body = self.num_layers * self.layer_parameters() + h
        return self.vocab_size * h + body + self.head_parameters(kind)

    def matmul_parameters(self, kind: str = "policy") -> int:
        """M: the parameters each token multiplies (layers and head; a tied head still
        multiplies, the embedding lookup does not)."""
        head = self.hidden_size * self.output_size(kind)
        return self.num_layers * self.layer_parameters() + head


_BUILTIN = {
    name: ModelShape(model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads,
                     model.intermediate_size, model.vocabulary, tie_embeddings=model.tie_word_embeddings)
    for name, model in BUILTIN_MODELS.items()
}

KNOWN_SHAPES: dict[str, ModelShape] = {
    **{f"builtin:{name}": shape for name, shape in _BUILTIN.items()},
    # from each model's published config.json
    "Qwen/Qwen2.5-0.5B": ModelShape(24, 896, 14, 2, 4864, 151936, tie_embeddings=True),
    "Qwen/Qwen2.5-1.5B": ModelShape(28, 1536, 12, 2, 8960, 151936, tie_embeddings=True),
    "Qwen/Qwen2.5-7B": ModelShape(28, 3584, 28, 4, 18944, 152064),
    "meta-llama/Meta-Llama-3-8B": ModelShape(32, 4096, 32, 8, 14336, 128256),
    "meta-llama/Llama-3.1-8B": ModelShape(32, 4096, 32, 8, 14336, 128256),
}
"""Shapes of models the planner knows by name (``path`` as a pipeline writes it)."""


def resolve_shape(path: str, base_dir: Path | None = None) -> ModelShape:
    """The shape of the model at ``path``: a known name, else a local dir's config.json."""
    known = _known(path)
    if known is not None:
        return known
    directory = Path(path) if base_dir is None else base_dir / path
    config_file = directory / "config.json"
    if config_file.is_file():
        try:
            return shape_from_config(read_config(directory), str(config_file))
        except ModelLoadError as error:
            raise PlacementError(f"cannot size model '{path}' for planning: {error}") from None
    names = ", ".join(sorted(KNOWN_SHAPES))
    raise PlacementError(
        f"cannot size model '{path}' for planning: it is not a local directory with a "
        f"config.json (looked at {config_file}) and not a known shape ({names}); give a "
        "local directory or one of the known names"
    )


def _known(path: str) -> ModelShape | None:
    if path in KNOWN_SHAPES:
        return KNOWN_SHAPES[path]
    lowered = {name.lower(): shape for name, shape in KNOWN_SHAPES.items()}
    # "Qwen2.5-7B-Instruct" has the base model's shape
    for name, shape in lowered.items():
        tail = name.rsplit("/", 1)[-1]
        if path.lower().rstrip("/").rsplit("/", 1)[-1].removesuffix("-instruct") == tail:
            return shape
    return None


def shape_from_config(config: dict[str, object], source: str = "config.json") -> ModelShape:
    """A shape from a transformers config.json (Llama, Qwen2, Mistral, GPT-style keys)."""

    def get(*keys: str, default: int | None = None) -> int:
        for key in keys:
            value = config.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return int(value)
        if default is not None:
            return default
        raise PlacementError(f"{source}: no '{keys[0]}'; cannot size the model for planning")

    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    return ModelShape(
        num_layers=get("num_hidden_layers", "n_layer"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads", default=heads),
        intermediate_size=get("intermediate_size", "n_inner", default=4 * hidden),
        vocab_size=get("vocab_size"),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        plain_logits=not transforms_logits(config),
    )


# ---- work -> FLOPs, bytes, memory -----------------------------------------------------


def forward_flops(shape: ModelShape, kind: str, num_sequences: float, seq_len: int) -> float:
    """2*M*T + 4*L*h*s*T for T = num_sequences * seq_len tokens."""
    tokens = num_sequences * seq_len
    dense = 2 * shape.matmul_parameters(kind) * tokens
    attention = 4 * shape.num_layers * shape.hidden_size * seq_len * tokens
    return float(dense + attention)


def shared_prompt_flops(shape: ModelShape, kind: str, num_sequences: float, group_size: int,
                        prompt: int, response: int) -> float:
    """:func:`forward_flops` of a pass that computes each prompt once per group of
    ``group_size`` rows (``flowrl.backends.shared_prompt``): the completions' tokens attend
    over prompt and completion, the prompts' only over the prompt."""
    prompts = num_sequences / group_size
    dense = 2 * shape.matmul_parameters(kind) * (num_sequences * response + prompts * prompt)
    per_context = 4 * shape.num_layers * shape.hidden_size
    attention = per_context * ((prompt + response) * num_sequences * response + prompt * prompts * prompt)
    return float(dense + attention)


def kv_cache_bytes(shape: ModelShape, dtype: str, num_sequences: float, seq_len: int) -> float:
    """Keys and values of every layer for ``num_sequences`` sequences of ``seq_len``."""
    per_token = 2 * shape.num_layers * shape.kv_width * DTYPE_BYTES[dtype]
    return float(num_sequences * seq_len * per_token)


def weight_bytes(shape: ModelShape, kind: str, dtype: str) -> float:
    return float(shape.num_parameters(kind) * DTYPE_BYTES[dtype])


ADAPTED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a decoder layer, as Llama and Qwen2 name them (``all-linear``)."""


def _adapted_linears(shape: ModelShape, targets: str | list[str]) -> list[tuple[str, int, int, int]]:
    """(name, in, out, layers) of each kind of linear layer that ``targets`` (``all-linear`` or
    module names) adapts. A name is matched by its last part; one with a layer index
    (``layers.3.self_attn.q_proj``) adapts that layer only. Names other than the decoder
    layers' linear layers add nothing (their shapes are unknown here; the head is refused)."""
    h, kv, inner = shape.hidden_size, shape.kv_width, shape.intermediate_size
    sizes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
             "gate_proj": (h, inner), "up_proj": (h, inner), "down_proj": (inner, h)}
    every = set(range(shape.num_layers))
    layers: dict[str, set[int]] = {}
    for target in ADAPTED_LINEARS if targets == "all-linear" else targets:
        name = target.rsplit(".", 1)[-1]
        if name in sizes:
            index = re.search(r"(?:^|\.)(\d+)\.", target)
            layers.setdefault(name, set()).update({int(index.group(1))} & every if index else every)
    return [(name, *sizes[name], len(indices)) for name, indices in layers.items()]


def adapter_parameters(shape: ModelShape, rank: int, targets: str | list[str]) -> int:
    """Parameters of LoRA adapters of ``rank`` on ``targets``: a linear layer of in x out
    gets rank * (in + out)."""
    return sum(rank * (fan_in + fan_out) * layers for _, fan_in, fan_out, layers in _adapted_linears(shape, targets))


def adapted_weight_parameters(shape: ModelShape, targets: str | list[str]) -> int:
    """Weights of the output and down projections that ``targets`` adapt: the static decoder
    keeps merged copies of those (the others it merges into the stacked copies it has anyway)."""
    return sum(fan_in * fan_out * layers for name, fan_in, fan_out, layers in _adapted_linears(shape, targets)
               if name in ("o_proj", "down_proj"))


def optimizer_bytes_per_parameter(dtype: str) -> int:
    """AdamW's state per trained parameter: two moments in the parameter's dtype for fp32
    (8 bytes); for a 16-bit model an fp32 master and two fp32 moments (12 bytes)."""
    return 8 if DTYPE_BYTES[dtype] >= 4 else 12


def optimizer_step_bytes_per_parameter(dtype: str) -> int:
    """Memory traffic of one optimizer step per parameter: fp32 AdamW reads p, g, m, v and
    writes p, m, v (28 bytes); a 16-bit model's step also copies its gradient to fp32 (2 + 4)
    and its master back (4 + 2), and its fused step runs on the fp32 master (40 in all)."""
    return 28 if DTYPE_BYTES[dtype] >= 4 else 40


def optimizer_step_bytes(parameters: int, dtype: str) -> float:
    """Memory traffic of one optimizer step over ``parameters`` trained parameters."""
    return float(parameters * optimizer_step_bytes_per_parameter(dtype))


def training_state_bytes(parameters: int, dtype: str, adapters: bool = False) -> float:
    """Gradients (P*b) plus the optimizer's state (:func:`optimizer_bytes_per_parameter`) of
    ``parameters`` trained parameters; adapters add their own weights (P*b), which the
    model's weights do not count: in fp32 4 + 4 + 8 bytes each, in 16 bits 2 + 2 + 12."""
    per_parameter = DTYPE_BYTES[dtype] * (2 if adapters else 1) + optimizer_bytes_per_parameter(dtype)
    return float(parameters * per_parameter)


def sharded_training_bytes(shape: ModelShape, kind: str, dtype: str, width: int) -> tuple[float, float]:
    """(resident, transient) bytes per device of training sharded over ``width`` devices
    (FSDP2, ``ModelSpec.sharded``), besides the whole copy of the weights every device keeps:
    resident, 1/width of the trained parameters, their gradients and the optimizer's state;
    transient, the parameters and gradients of what is gathered at once in a pass: one
    decoder layer plus the outer unit (embeddings, final norm, head), which stays gathered
    from its forward to its backward."""
    per_parameter = DTYPE_BYTES[dtype]
    outer = shape.num_parameters(kind) - shape.num_layers * shape.layer_parameters()
    resident = (shape.num_parameters(kind) * (2 * per_parameter + optimizer_bytes_per_parameter(dtype))
                / max(1, width))
    return resident, 2.0 * per_parameter * (shape.layer_parameters() + outer)


FUSED_CHUNK_ELEMENTS = 1 << 26
"""Logits in one chunk of the fused output head (``flowrl.algorithms.logprobs``, same value)."""


def fused_chunk_rows(vocab: int) -> int:
    """Rows per chunk of the fused output head (``flowrl.algorithms.logprobs.fused_chunk_rows``,
    restated here so that planning does not import torch)."""
    return max(64, FUSED_CHUNK_ELEMENTS // max(vocab, 1))


def logits_bytes(shape: ModelShape, kind: str, tokens: float, dtype: str = "fp32",
                 training: bool = False) -> float:
    """The output head's transient memory over ``tokens`` tokens (see the module docstring),
    a sharded model's included (its pass stands in a fused head for its own); every token's
    logits at once for a model whose logits are not the head's plain product."""
    vocab = shape.output_size(kind)
    if vocab == 1:
        return float(tokens * 4)
    rows = min(tokens, fused_chunk_rows(vocab)) if shape.plain_logits else tokens
    per_logit = DTYPE_BYTES[dtype] + 4 + (4 if training else 0)
    summed = 4 * tokens * shape.hidden_size if training and shape.plain_logits else 0
    return float(rows * vocab * per_logit + summed)


def layer_activation_bytes(shape: ModelShape, dtype: str, compiled: bool = False) -> float:
    """Bytes one decoder layer keeps for backward per token (see the module docstring)."""
    b = DTYPE_BYTES[dtype]
    h, mlp, kv = shape.hidden_size, shape.intermediate_size, shape.kv_width
    if compiled:
        return float(b * (6 * h + 3 * mlp + 2 * kv))
    upcast = 4 * h if b < 4 else 0
    return float(b * (8 * h + 4 * mlp + 2 * kv) + upcast)


def activation_bytes(
    shape: ModelShape, dtype: str, num_sequences: float, seq_len: int, checkpointing: bool,
    compiled: bool = False,
) -> float:
    """Activations kept for backward in one micro-batch (see the module docstring); layers
    recomputed under checkpointing run eagerly."""
    tokens = num_sequences * seq_len
    one_layer = tokens * layer_activation_bytes(shape, dtype, compiled and not checkpointing)
    if checkpointing:
        return float(shape.num_layers * tokens * shape.hidden_size * DTYPE_BYTES[dtype] + one_layer)
    return float(shape.num_layers * one_layer)


def inference_bytes(shape: ModelShape, kind: str, dtype: str, num_sequences: float,
                    seq_len: int) -> float:
    """Transient memory of a no-grad forward: the output head's chunk, the residual stream
    and a few hidden-sized buffers, and the MLP's three intermediate tensors of one layer."""
    tokens = num_sequences * seq_len
    hidden = tokens * (4 * shape.hidden_size + 3 * shape.intermediate_size) * DTYPE_BYTES[dtype]
    return logits_bytes(shape, kind, tokens, dtype) + hidden


def decoder_cache_bytes(shape: ModelShape, kind: str, dtype: str, num_sequences: float,
                        seq_len: int) -> float:
    """What generation keeps between calls (the static decoder reuses it every step): the
    KV cache, the sampling noise (rows x V, fp32) and the stacked q/k/v and gate/up
    weights of every layer."""
    h = shape.hidden_size
    stacked = shape.num_layers * (h * (h + 2 * shape.kv_width) + 2 * h * shape.intermediate_size)
    noise = num_sequences * shape.output_size(kind) * 4
    return kv_cache_bytes(shape, dtype, num_sequences, seq_len) + noise + stacked * DTYPE_BYTES[dtype]


MIB = 1 << 20
CUBLAS_WORKSPACE_BYTES = {"hopper": 32 * MIB, "blackwell": 32 * MIB}
"""The workspace cuBLAS keeps for each (thread, stream) that runs a matrix product, in the
allocator's memory: 32 MiB on Hopper (measured on an H100 with torch 2.11: each new thread or
stream that ran a bf16 product added 32 MiB to ``memory_allocated``) and Blackwell."""
CUBLAS_WORKSPACE_OTHER_BYTES = 8 * MIB + 128 * 1024
"""torch's default cuBLAS workspace on other GPUs (two 4 MiB and eight 16 KiB chunks)."""
CUBLASLT_WORKSPACE_BYTES = 1 * MIB
"""cuBLASLt's own workspace beside it (the products with a bias epilogue): 1 MiB, measured."""


def matmul_workspace_bytes(arch: str) -> float:
    """What one thread's matrix products on one stream keep on a GPU of ``arch``."""
    return float(CUBLAS_WORKSPACE_BYTES.get(arch, CUBLAS_WORKSPACE_OTHER_BYTES) + CUBLASLT_WORKSPACE_BYTES)


UNKNOWN_L2_BYTES = 128 * MIB
"""A GPU whose L2 size is not known: at least that of the largest listed card."""


def compile_benchmark_bytes(l2_cache_mib: float | None) -> float:
    """What a node's compiled code may allocate beyond its tensors on a GPU: when torch's
    compiler times a kernel's variants (a compiled pass's first call, or a new shape), it
    allocates a buffer the size of the L2 cache to flush it between timings. On an H100 the
    tiny GPU pipeline's first reference and update calls peaked 50 MiB above their tensors
    that way (the card's L2), which for a small model is most of the call's memory."""
    return float(l2_cache_mib * MIB) if l2_cache_mib is not None else float(UNKNOWN_L2_BYTES)


# ---- CPU rates ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Overheads:
    """What running a model costs beyond its FLOPs and bytes (Python, operator dispatch,
    kernel launches): per decoder layer of each pass or decode step, per layer and token of a
    pass or row of a step, and per pass or step."""

    forward_layer_s: float
    """One layer of a no-grad forward pass."""
    train_layer_s: float
    """One layer of a pass's forward and backward."""
    decode_layer_s: float
    """One layer of a decode step."""
    forward_pass_s: float = 0.0
    """One forward pass, beside its layers (embedding, head, the model's own set-up)."""
    train_pass_s: float = 0.0
    """One forward and backward pass, beside its layers."""
    decode_step_s: float = 0.0
    """One decode step, beside its layers (sampling, the step's bookkeeping)."""
    forward_token_s: float = 0.0
    """One layer of a no-grad forward, per token of the pass (its small element-wise
    operations: norms, rotary positions, the gated activation, the attention's softmax)."""
    train_token_s: float = 0.0
    """One layer of a forward and backward, per token of the pass."""
    decode_row_s: float = 0.0
    """One layer of a decode step, per row decoded."""

    def per_layer_text(self) -> str:
        """A layer's overheads (its own, and per token or row) in words, as ``flowrl run`` and
        ``flowrl plan`` print them."""
        return (f"a layer's overhead {self.forward_layer_s * 1e3:.2f} ms + {self.forward_token_s * 1e6:.2f} us "
                f"per token per forward pass, {self.train_layer_s * 1e3:.2f} ms + {self.train_token_s * 1e6:.2f} us "
                f"per token per forward and backward, {self.decode_layer_s * 1e3:.2f} ms + "
                f"{self.decode_row_s * 1e6:.2f} us per row per decode step")


CPU_OVERHEADS = Overheads(forward_layer_s=2e-5, train_layer_s=6e-5, decode_layer_s=2e-5)
"""A CPU slot's overheads until measured (``flowrl.planner.overhead_probe``); none per token
or row, so a plan on them (after a failed probe) is the more optimistic for small models."""


@dataclass(frozen=True)
class CpuRates:
    """What one CPU slot achieves (measured rates, so no efficiency factor applies)."""

    flops_per_s: float = 2.0e10
    """Sustained fp32 matmul rate of one slot, FLOP/s. Default 2e10 (a few cores)."""
    bandwidth_gbs: float = 10.0
    """Sustained memory copy bandwidth of one slot, GB/s. Default 10."""
    reward_s_per_sequence: float = 2.0e-5
    """Python reward function time per completion, s. Default 2e-5."""
    overheads: Overheads = CPU_OVERHEADS
    """A model's costs beyond its FLOPs and bytes on the slot. Default ``CPU_OVERHEADS``."""


def measure_cpu_rates(matrix_size: int = 256, repeats: int = 5, overheads: Overheads | None = None) -> CpuRates:
    """Time a small fp32 matmul and a memory copy on this machine (well under a second), and
    take ``overheads`` as measured elsewhere (a run's CPU worker) or, None, measure them here
    on a tiny model's passes and decode steps (``overhead_probe``).

    The best of ``repeats`` is kept: the planner wants what the slot can do, not what a
    busy moment allowed. The matmul is timed on one thread and on the BLAS library's own
    threads, and the faster rate is kept: while other processes hold the cores, the
    threads of a parallel matmul wait for each other (on 2 busy cores 1.2 GFLOP/s against
    101 on one thread), so the parallel rate alone would make every plan made on a busy
    machine scores of times too slow.
    """
    import numpy  # only here: the planner itself is plain arithmetic
    from threadpoolctl import threadpool_limits

    left = numpy.ones((matrix_size, matrix_size), dtype=numpy.float32)
    right = numpy.ones((matrix_size, matrix_size), dtype=numpy.float32)
    source = numpy.ones(8 * 2**20 // 4, dtype=numpy.float32)  # 8 MiB: past most caches
    target = numpy.empty_like(source)

    def best_matmul_s(threads: int | None) -> float:
        best = float("inf")
        with threadpool_limits(limits=threads):
            for _ in range(repeats):
                start = time.perf_counter()
                numpy.matmul(left, right)
                best = min(best, time.perf_counter() - start)
        return best

    best_copy_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        numpy.copyto(target, source)
        best_copy_s = min(best_copy_s, time.perf_counter() - start)
    flops = 2 * matrix_size**3 / max(min(best_matmul_s(None), best_matmul_s(1)), 1e-9)
    bandwidth_gbs = 2 * source.nbytes / max(best_copy_s, 1e-9) / 1e9  # read + write
    if overheads is None:
        from flowrl.planner.overhead_probe import cpu_overheads_or_defaults

        overheads = cpu_overheads_or_defaults(repeats)
    return CpuRates(flops_per_s=flops, bandwidth_gbs=bandwidth_gbs, overheads=overheads)
