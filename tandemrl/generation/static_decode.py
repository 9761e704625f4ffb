"""Static-cache decode for Llama-family models: fixed row slots, steps as graph replays.

Families (``unsupported_reason`` refuses anything else, naming what it lacks): Llama (default
or Llama 3 rotary scaling), Qwen2/2.5, Qwen3 (queries and keys RMS-normalised per head before
the rotary embedding), Mistral without a sliding window, Phi-3 (its projections come fused
already). Gemma, mixture-of-experts models and anything with sliding-window layers, another
activation or a partial rotary embedding decode through transformers' cache instead (the torch
engine falls back with a log line, or refuses ``cuda_graphs: on``).

What it owns: a KV cache of shape ``[layers, 2, slots, kv_heads, max_len, head_dim]`` (keys and
values), the per-slot decode state (the token to feed, its position, sampling parameters) and a
hand-written decode step over the transformers model's own parameters, captured as CUDA graphs.
The torch engine (``torch_engine.py``) owns the requests; it maps each running sequence to a
slot and calls ``prefill`` (admission, recompute-KV), ``set_rows`` and ``step``.

One step, for slots ``[0, rows)`` (``rows`` a power-of-two bucket above the highest busy slot):
embed each slot's token, run every layer (RMSNorm, one fused QKV projection, rotary embedding, write
K/V at the slot's position, attention over the slot's cache positions up to its own within the first
``length`` (``decode_attention.py``: one Triton kernel on CUDA, which also rotates the queries and
the new keys and writes the new keys/values), output projection, RMSNorm, one fused gate/up
projection, SiLU, down projection (as ``DOWN_SPLITS`` partial products that the next residual add
sums)), then sample one token per slot from the tempered distribution (inverse CDF of a host-drawn
uniform, optional top-p; greedy slots take the argmax; on CUDA without top-p two Triton kernels,
``decode_sampler.py``) and write the token, its logprob, the next position and the next input token
in place. A *launch* runs ``steps`` such steps back to back (the decoder's ``steps``; one graph
holds them all on CUDA): each step reads the tokens and positions the one before it wrote, so the
host uploads ``steps`` uniforms per slot and reads ``steps`` results per slot once per launch. Free
slots inside the bucket are computed and ignored. Shapes are static per ``(rows, length, top_p)``,
so on CUDA each such key is captured once as a graph and replayed; on CPU the same code runs eagerly
(tests).

Weights are *views*, never copies: ``fuse_projections`` concatenates q/k/v (and gate/up) once and
rebinds the model's own parameters as views of the fused tensors. A weight update that
copies into the parameters in place (the engine's ``update_weights``) therefore updates the
fused tensors and every captured graph sees the new weights without recapture. Prefill runs
the same layer code over all the right-padded prompts' tokens at once (causal attention per
row through ``scaled_dot_product_attention``), writing keys/values straight into the slots;
on CUDA it is compiled too, with dynamic token counts.

Logprob convention: the torch engine's (``log_softmax(logits / temperature)`` of float32 logits;
temperature 1 for greedy rows; top-p changes the draw, not the reported logprob).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from tandemrl.generation import decode_sampler
from tandemrl.generation.decode_attention import decode_attention, rotate_half

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "phi3")
# Rotary embeddings whose frequencies are fixed at load time (the step reads them once).
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Smallest graph buckets: fewer, larger graphs; a step never attends fewer cache positions.
MIN_ROWS_BUCKET = 8
MIN_LENGTH_BUCKET = 64
# Dynamo's per-code-object recompile limit while a compiled static decoder exists (see
# StaticDecoder.__init__); torch's default is 8.
RECOMPILE_LIMIT = 128
# Vocabulary block of the two-level inverse-CDF sampler (see StaticDecoder._sample_tokens).
SAMPLE_BLOCK = 128
# Decode step: rotate the queries inside the attention kernel (``decode_attention``'s cos/sin)
# instead of in a compiled kernel of their own (one kernel a layer less).
ROPE_IN_ATTENTION = True
# Decode step (with ROPE_IN_ATTENTION): the step's new keys (rotated) and values go into the
# cache from inside the attention kernel (``decode_attention``'s new_k/new_v), not from a
# compiled kernel of their own after the QKV projection (one kernel a layer less).
KV_WRITE_IN_ATTENTION = True
# Decode step: the down projection as DOWN_SPLITS batched products over slices of the
# intermediate size, their partial sums added by the next layer's residual/norm kernel instead
# of cuBLAS's split-K reduction kernel. 1: one plain product.
DOWN_SPLITS = 4
# The same for the attention's output projection (its partial sums added in the residual add
# before the post-attention norm). 1: one plain product.
O_SPLITS = 2
# The same for the fused QKV projection (its partial sums and bias added, in float32, in the
# kernel that rotates the keys and writes the cache). 1: one plain product with its bias. On the
# H200 two splits were slower (0.5B, 256 rows: 1.309 ms a step against 1.299; the split product
# saved 31 µs and the kernel summing it cost 40: docs/benchmarks.md, session 7).
QKV_SPLITS = 1


def _splits(requested: int, features: int) -> int:
    """``requested`` partial products over ``features`` input features, or 1 (one plain
    product) when they do not divide evenly."""
    return requested if features % max(requested, 1) == 0 else 1


def allow_compiled_calls_during_traces() -> None:
    """Let a compiled function run (eagerly) while another thread of the process traces.

    An engine sharing its process with a compiled trainer, each in its own thread: while one
    thread traces a new graph, FX's tracing flag is process-wide, and a compiled function called
    from the other thread meanwhile raises ("Detected that you are using FX to symbolically
    trace a dynamo-optimized function"). With dynamo's ``error_on_nested_fx_trace`` off that call
    runs its eager code instead (same result, slower, once in a while); compilations themselves
    stay serialised by dynamo's own lock.
    """
    from torch._dynamo import config as dynamo_config

    dynamo_config.error_on_nested_fx_trace = False


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot use the static decode step, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return f"rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or 2 * rotary.inv_freq.numel() != head_dim:
        return "a partial rotary embedding (only every dimension of the head rotated)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if getattr(config, "use_sliding_window", False) or (
        model_type in ("mistral", "phi3") and getattr(config, "sliding_window", None) is not None
    ):
        return "sliding-window attention"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))} (only full attention)"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


@dataclass
class LayerWeights:
    """One decoder layer's tensors, all views of the model's parameters."""

    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    # Qwen3: per-head RMSNorm weights of the queries and keys (before the rotary embedding).
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor


def _adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` lie back to back in one storage, in order."""
    storage = tensors[0].untyped_storage().data_ptr()
    return all(
        tensor.untyped_storage().data_ptr() == storage and tensor.is_contiguous()
        for tensor in tensors
    ) and all(
        tensors[i + 1].storage_offset() == tensors[i].storage_offset() + tensors[i].numel()
        for i in range(len(tensors) - 1)
    )


def _span(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor over adjacent ``tensors`` (concatenated along dim 0), sharing their storage."""
    first = tensors[0]
    shape = (sum(tensor.shape[0] for tensor in tensors), *first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)


def _fuse_linears(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate ``linears`` along the output dim and rebind each as a view of the result."""
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    if any(bias is None for bias in biases) and not all(bias is None for bias in biases):
        raise ValueError("static decode: fused projections must all have biases or none")
    has_bias = biases[0] is not None
    if _adjacent(weights) and (not has_bias or _adjacent(biases)):
        return _span(weights), _span(biases) if has_bias else None
    sizes = [weight.shape[0] for weight in weights]
    with torch.no_grad():
        fused = torch.cat([weight.detach() for weight in weights])
        for linear, part in zip(linears, fused.split(sizes), strict=True):
            linear.weight = torch.nn.Parameter(part, requires_grad=linear.weight.requires_grad)
        fused_bias = None
        if has_bias:
            fused_bias = torch.cat([bias.detach() for bias in biases])
            for linear, part in zip(linears, fused_bias.split(sizes), strict=True):
                linear.bias = torch.nn.Parameter(part, requires_grad=linear.bias.requires_grad)
    return fused, fused_bias


def fuse_projections(model: torch.nn.Module) -> list[LayerWeights]:
    """Per-layer weight views; q/k/v and gate/up become views of one fused tensor each.

    Idempotent: a model whose projections are already adjacent views is left as it is.
    """
    layers = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if hasattr(attention, "qkv_proj"):  # Phi-3: fused in the checkpoint, q | k | v rows
            qkv_weight, qkv_bias = attention.qkv_proj.weight, attention.qkv_proj.bias
        else:
            qkv_weight, qkv_bias = _fuse_linears(
                [attention.q_proj, attention.k_proj, attention.v_proj]
            )
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate | up rows, as the fused layout here
            gate_up_weight = mlp.gate_up_proj.weight
        else:
            gate_up_weight, _ = _fuse_linears([mlp.gate_proj, mlp.up_proj])
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv_weight=qkv_weight,
                qkv_bias=qkv_bias,
                q_norm=q_norm.weight if q_norm is not None else None,
                k_norm=k_norm.weight if k_norm is not None else None,
                o_weight=attention.o_proj.weight,
                o_bias=attention.o_proj.bias,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up_weight=gate_up_weight,
                down_weight=mlp.down_proj.weight,
            )
        )
    return layers


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def bucket(value: int, minimum: int, cap: int) -> int:
    """Smallest power of two >= ``value`` (at least ``minimum``), at most ``cap``."""
    size = minimum
    while size < value:
        size *= 2
    return min(size, cap)


class _LaunchViews(NamedTuple):
    """One rows bucket's views of a launch's buffers ([steps, rows] draws, [steps, rows, 2]
    results) on the device and in one staging pair, and the numpy view the host draws into."""

    device_uniforms: torch.Tensor
    device_out: torch.Tensor
    staged_uniforms: torch.Tensor
    results: torch.Tensor
    drawn: np.ndarray


# A launch's uniforms, per slot: one draw, or one per step of the launch.
Draws = Sequence[float] | Sequence[Sequence[float]]


@dataclass
class LaunchedStep:
    """A launch's decode steps queued on the device (``StaticDecoder.launch``)."""

    slots: list[int]
    # Host [steps, rows, 2]: each step's tokens and logprobs (valid once ``done`` completes).
    results: torch.Tensor
    done: torch.cuda.Event | None  # None on CPU, where the steps ran synchronously


class StaticDecoder:
    """Slots, their KV cache and the decode step of one model (see the module docstring).

    ``use_graphs``: capture each ``(rows, length, top_p)`` launch as a CUDA graph (CUDA only).
    ``steps``: decode steps per launch (module docstring). More steps share one graph launch,
    one upload and one download, and one wait of the host; a row that finishes inside a
    launch is still computed to its end (its extra tokens are the caller's to drop).
    ``compile_step``: fuse the elementwise work around the matrix products with
    ``torch.compile`` (CUDA only; compiled once per shape family, before any capture).
    ``compile_mode``: ``torch.compile``'s mode for those functions (None: its default;
    ``"max-autotune-no-cudagraphs"`` also times Triton templates against cuBLAS for each
    matrix product, at a much longer compilation per row bucket).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        slots: int,
        max_len: int,
        use_graphs: bool,
        compile_step: bool,
        compile_mode: str | None = None,
        steps: int = 1,
    ) -> None:
        if steps < 1:
            raise ValueError(f"static decode: steps per launch must be >= 1, got {steps}")
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"static decode does not support this model: {reason}")
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        if (use_graphs or compile_step) and self.device.type != "cuda":
            raise ValueError("static decode: CUDA graphs and torch.compile need a CUDA model")
        config = model.config
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.group = self.heads // self.kv_heads
        self.grouped_query = self.group > 1
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.layers = fuse_projections(model)
        self.embedding = model.get_input_embeddings().weight
        self.final_norm = model.model.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.to(self.device, torch.float32)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.slots, self.max_len, self.steps = slots, max_len, steps
        self.use_graphs, self.compile_step = use_graphs, compile_step

        self.cache = self.keys = self.values = torch.empty(0)
        self.allocate()
        on = {"device": self.device}
        self.tokens = torch.zeros(slots, dtype=torch.long, **on)
        self.positions = torch.zeros(slots, dtype=torch.long, **on)
        self.temperatures = torch.ones(slots, dtype=torch.float32, **on)
        self.greedy = torch.zeros(slots, dtype=torch.bool, **on)
        self.top_p = torch.ones(slots, dtype=torch.float32, **on)
        # A launch's draws and results are flat buffers viewed per rows bucket as [steps, rows]
        # and [steps, rows, 2] (``_launch_views``): one contiguous block per launch whatever
        # the bucket, so each copy between host and device is one plain copy.
        self.uniforms = torch.full((steps * slots,), 0.5, dtype=torch.float32, **on)
        # Per step and slot: the sampled token and its logprob (float64 holds every token id
        # exactly).
        self.out = torch.zeros(steps * slots * 2, dtype=torch.float64, **on)
        # Host side of each launch (uniforms in, tokens and logprobs out), pinned on CUDA.
        pinned = self.device.type == "cuda"
        self._uniform_staging = [
            torch.zeros(steps * slots, dtype=torch.float32, pin_memory=pinned) for _ in range(2)
        ]
        self._result_staging = [
            torch.zeros(steps * slots * 2, dtype=torch.float64, pin_memory=pinned) for _ in range(2)
        ]
        # The host side of a launch goes through views made once per (rows bucket, staging
        # buffer) (``_views``), numpy where the host writes, and two reused events: every torch
        # call lets go of the GIL, and beside a trainer thread of the same process each one
        # took tens of microseconds to get it back (docs/benchmarks.md).
        self._views: dict[tuple[int, int], _LaunchViews] = {}
        self._done_events = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._launches = 0
        # Offsets of (keys|values, slot, kv head) rows in one layer's flattened cache.
        kv_rows = torch.arange(2 * slots * self.kv_heads, **on).view(2, slots, self.kv_heads)
        self.kv_row_offsets = kv_rows * max_len
        self.rope_in_attention = ROPE_IN_ATTENTION
        self.kv_write_in_attention = ROPE_IN_ATTENTION and KV_WRITE_IN_ATTENTION
        intermediate = int(self.layers[0].down_weight.shape[1])
        self.down_splits = _splits(DOWN_SPLITS, intermediate)
        self.o_splits = _splits(O_SPLITS, self.heads * self.head_dim)
        self.qkv_splits = _splits(QKV_SPLITS, int(config.hidden_size))
        self.no_delta = torch.zeros(slots, config.hidden_size, dtype=self.dtype, **on)

        self._attention_in: Callable[..., Any] = self._attention_in_eager
        self._attention_out_mlp: Callable[..., Any] = self._attention_out_mlp_eager
        self._qkv: Callable[..., Any] = self._qkv_eager
        self._out_mlp_step: Callable[..., Any] = self._out_mlp
        self._head: Callable[..., Any] = self._head_eager
        self._vocab_blocks: Callable[..., Any] = self._vocab_blocks_eager
        self._write_back: Callable[..., Any] = self._write_back_eager
        self._prefill_in: Callable[..., Any] = self._prefill_in_eager
        self._prefill_out_mlp: Callable[..., Any] = self._prefill_out_mlp_eager
        if compile_step:
            # Each compiled function below is one code object for every decoder in the process:
            # its cache holds one entry per (rows, length) bucket family and per decoder (guards
            # see ``self``), so a process that builds several engines (benchmarks, colocated
            # rebuilds) passes dynamo's default of 8 and the next capture would fail with
            # FailOnRecompileLimitHit (fullgraph). Raise the per-code-object limit.
            from torch._dynamo import config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
            allow_compiled_calls_during_traces()
            # Prefill: token counts vary with every admission; the second shape seen compiles
            # one graph with dynamic sizes (torch.compile's automatic dynamic shapes).
            prefill = {"fullgraph": True}
            self._prefill_in = torch.compile(self._prefill_in_eager, **prefill)
            self._prefill_out_mlp = torch.compile(self._prefill_out_mlp_eager, **prefill)
            compiled = {"fullgraph": True, "mode": compile_mode}
            self._attention_in = torch.compile(self._attention_in_eager, **compiled)
            self._attention_out_mlp = torch.compile(self._attention_out_mlp_eager, **compiled)
            # KV_WRITE_IN_ATTENTION: the attention kernel writes the cache, so it runs between
            # these two (outside torch.compile, which would treat the cache it writes as a
            # mutated graph input).
            self._qkv = torch.compile(self._qkv_eager, **compiled)
            self._out_mlp_step = torch.compile(self._out_mlp, **compiled)
            self._head = torch.compile(self._head_eager, **compiled)
            # Only the full-vocabulary pass: inductor cannot fuse a long scan with reductions.
            self._vocab_blocks = torch.compile(self._vocab_blocks_eager, fullgraph=True)
            self._write_back = torch.compile(self._write_back_eager, fullgraph=True)
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        # The stream graphs are captured on (None: torch's own side stream). An engine on a
        # share of the SMs (tandemrl.sm_partition) captures on a stream of that share.
        self.capture_stream: torch.cuda.Stream | None = None
        # Held while a graph is captured, if set. A device-wide synchronize from another thread
        # of the process fails while a capture is open (cudaErrorStreamCaptureUnsupported, seen
        # when a trainer sharing the process autotuned a compiled kernel), so such a process
        # holds the same lock around that thread's CUDA work.
        self.capture_lock: threading.Lock | None = None
        self._pool: Any = torch.cuda.graph_pool_handle() if use_graphs else None
        # Keys whose step has run (warm-up) at least once: release() keeps this set.
        self._warmed: set[tuple[int, int, bool]] = set()

    @property
    def allocated(self) -> bool:
        return self.cache.numel() > 0

    def allocate(self) -> None:
        """(Re)create the KV cache; every slot's keys/values start at zero."""
        if self.allocated:
            return
        shape = (len(self.layers), 2, self.slots, self.kv_heads, self.max_len, self.head_dim)
        # Zeros, not empty: a masked position must never hold a NaN (0 x NaN poisons attention).
        # Keys and values share one tensor, so a step writes both with one copy per layer.
        self.cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.keys, self.values = self.cache[:, 0], self.cache[:, 1]
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()

    def release(self) -> None:
        """Free the KV cache and the graphs (and their memory pool); ``allocate`` rebuilds.

        The compiled step functions survive, so a rebuild recaptures graphs (without the
        warm-up runs of a first capture) but never recompiles.
        """
        self._graphs.clear()
        self._pool = None
        self.cache = self.keys = self.values = torch.empty(0)

    @property
    def cache_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    # ------------------------------------------------------------------ state of the slots

    @torch.inference_mode()
    def prefill(self, slots: Sequence[int], prefixes: Sequence[Sequence[int]]) -> None:
        """Keys/values of each ``prefixes[i]`` (positions 0..len-1) into slot ``slots[i]``."""
        work = [(slot, list(prefix)) for slot, prefix in zip(slots, prefixes, strict=True)]
        work = [(slot, prefix) for slot, prefix in work if prefix]
        if not work:
            return
        width = max(len(prefix) for _, prefix in work)
        if width > self.max_len:
            raise ValueError(f"static decode: prefix of {width} tokens > cache length")
        # Right padding: causal attention never lets a real token see the padding after it,
        # and the padding's keys/values land on positions the row overwrites before reading.
        input_ids = torch.zeros(len(work), width, dtype=torch.long)
        for row, (_, prefix) in enumerate(work):
            input_ids[row, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
        index = torch.tensor([slot for slot, _ in work], dtype=torch.long)
        self._prefill_rows(input_ids.to(self.device), index.to(self.device))

    def _prefill_rows(self, input_ids: torch.Tensor, index: torch.Tensor) -> None:
        """Keys/values of ``input_ids`` [n, width] (positions 0..width-1) into slots ``index``.

        The decode step's own layer code over all n x width tokens at once (the fused QKV
        and gate/up projections, the same rotary embedding and cache write), with causal
        attention per row (``scaled_dot_product_attention``); the last layer stops after its
        cache write, and no logits are computed.
        """
        rows, width = input_ids.shape
        positions = torch.arange(width, device=self.device).repeat(rows)
        hidden = F.embedding(input_ids.reshape(-1), self.embedding)
        cos, sin = self._rotary(positions)
        delta = torch.zeros_like(hidden)
        # Cache rows of the new keys/values, in the order [2, rows, width, kv_heads].
        offsets = self.kv_row_offsets[:, index][:, :, None, :]
        write_rows = (offsets + torch.arange(width, device=self.device)[:, None]).reshape(-1)
        last = len(self.layers) - 1
        for layer, weights in enumerate(self.layers):
            hidden, q = self._prefill_in(
                hidden,
                delta,
                weights.input_norm,
                weights.qkv_weight,
                weights.qkv_bias,
                weights.q_norm,
                weights.k_norm,
                cos,
                sin,
                self.cache[layer].view(-1, self.head_dim),
                write_rows,
            )
            if layer == last:
                break
            hidden, delta = self._prefill_out_mlp(
                hidden,
                q,
                self.keys[layer][index, :, :width],
                self.values[layer][index, :, :width],
                weights.o_weight,
                weights.o_bias,
                weights.post_norm,
                weights.gate_up_weight,
                weights.down_weight,
            )

    @torch.inference_mode()
    def set_rows(
        self,
        slots: Sequence[int],
        *,
        tokens: Sequence[int],
        positions: Sequence[int],
        temperatures: Sequence[float],
        top_ps: Sequence[float],
    ) -> None:
        """Next input token, its position and the sampling parameters of each slot."""
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        self.tokens[index] = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        self.positions[index] = torch.tensor(list(positions), device=self.device)
        self.greedy[index] = torch.tensor([t == 0 for t in temperatures], device=self.device)
        self.temperatures[index] = torch.tensor(
            [t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32, device=self.device
        )
        self.top_p[index] = torch.tensor(list(top_ps), dtype=torch.float32, device=self.device)

    @torch.inference_mode()
    def step(
        self, slots: Sequence[int], uniforms: Draws, max_position: int, top_p: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One launch (``steps`` decode steps); see ``launch`` and ``collect``."""
        return self.collect(self.launch(slots, uniforms, max_position, top_p))

    def _launch_views_of(self, rows: int, parity: int) -> _LaunchViews:
        """The views a launch of ``rows`` rows through staging buffer ``parity`` uses (made
        once: the buffers live as long as the decoder)."""
        views = self._views.get((rows, parity))
        if views is None:
            device_uniforms, device_out = self._launch_views(rows, (self.uniforms, self.out))
            staged_uniforms, results = self._launch_views(
                rows, (self._uniform_staging[parity], self._result_staging[parity])
            )
            views = _LaunchViews(
                device_uniforms, device_out, staged_uniforms, results, staged_uniforms.numpy()
            )
            self._views[(rows, parity)] = views
        return views

    def _launch_views(
        self, rows: int, tensors: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A rows bucket's views of flat (uniforms, results) buffers: [steps, rows] and
        [steps, rows, 2], each one contiguous block at the buffer's start."""
        uniforms, results = tensors
        return (
            uniforms[: self.steps * rows].view(self.steps, rows),
            results[: self.steps * rows * 2].view(self.steps, rows, 2),
        )

    @torch.inference_mode()
    def launch(
        self, slots: Sequence[int], uniforms: Draws, max_position: int, top_p: bool
    ) -> LaunchedStep:
        """Queue one launch (``steps`` decode steps) on the device; return without waiting.

        ``uniforms``: slot ``slots[i]``'s draws, ``uniforms[i]`` (one float per slot, or
        ``steps`` of them in the order of the steps); ``max_position`` the largest position fed
        to the first step (the last step feeds ``max_position + steps - 1`` at most). The
        outputs are copied to pinned host memory behind the steps; ``collect`` waits.
        Launches queue in order, so state written after one (``prefill``, ``set_rows``, weight
        copies) takes effect from the next launch on.
        """
        if not self.allocated:
            raise RuntimeError("static decode: step after release() without allocate()")
        slots = list(slots)
        draws = np.asarray(uniforms, dtype=np.float32).reshape(len(slots), self.steps)
        rows = bucket(max(slots) + 1, MIN_ROWS_BUCKET, self.slots)
        length = bucket(max_position + self.steps, MIN_LENGTH_BUCKET, self.max_len)
        # Two host buffers, alternating: a launch never overwrites what the one before it
        # still has to read (the engine keeps at most one launch in flight).
        self._launches += 1
        parity = self._launches % 2
        views = self._launch_views_of(rows, parity)
        views.drawn[:] = 0.5
        views.drawn[:, slots] = draws.T
        views.device_uniforms.copy_(views.staged_uniforms, non_blocking=True)
        key = (rows, length, top_p)
        if self.use_graphs:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(key)
            graph.replay()
        else:
            self._decode(*key)
        # Both sides contiguous: a strided device-to-host copy would go through an unpinned
        # temporary, and such a copy waits for the device (the launch just queued included),
        # which took the launch in flight away whenever the rows bucket was below the slots.
        views.results.copy_(views.device_out, non_blocking=True)
        done = self._done_events[parity]
        if done is not None:
            done.record()
        return LaunchedStep(slots, views.results, done)

    @staticmethod
    def collect(launched: LaunchedStep) -> tuple[list[list[int]], list[list[float]]]:
        """Wait for a launch; per step, its tokens and logprobs in the order of its slots
        (``tokens[k][i]``: step k's token of slot ``slots[i]``)."""
        if launched.done is not None:
            launched.done.synchronize()
        values = launched.results.numpy()[:, launched.slots]
        return values[..., 0].astype(np.int64).tolist(), values[..., 1].tolist()

    # ------------------------------------------------------------------ the step

    def _capture(self, key: tuple[int, int, bool]) -> torch.cuda.CUDAGraph:
        # Warm-up runs (compilation, Triton autotuning, cuBLAS handles) happen on a side
        # stream, as capture requires; they write the same keys/values the real step writes,
        # and the slots' tokens/positions/outputs are restored afterwards. A key captured
        # before (a colocated engine recaptures after every wake, release() dropped its graphs)
        # has had all of that already: it is captured straight away.
        saved = [tensor.clone() for tensor in (self.tokens, self.positions, self.out)]

        def restore() -> None:
            for tensor, copy in zip((self.tokens, self.positions, self.out), saved, strict=True):
                tensor.copy_(copy)

        if key not in self._warmed:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._decode(*key)
                    restore()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._warmed.add(key)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread (a trainer sharing the GPU) may use CUDA meanwhile,
        # short of synchronizing the whole device (see ``capture_lock``).
        with (
            self.capture_lock or contextlib.nullcontext(),
            torch.cuda.graph(
                graph,
                pool=self._pool,
                stream=self.capture_stream,
                capture_error_mode="thread_local",
            ),
        ):
            self._decode(*key)
        restore()
        self._graphs[key] = graph
        return graph

    def _decode(self, rows: int, length: int, top_p: bool) -> None:
        """One launch: ``steps`` decode steps of slots [0, rows)."""
        uniforms, out = self._launch_views(rows, (self.uniforms, self.out))
        for step in range(self.steps):
            logits = self.forward(rows, length)
            token, logprob = self._sample_tokens(
                logits,
                self.temperatures[:rows],
                self.greedy[:rows],
                uniforms[step],
                self.top_p[:rows] if top_p else None,
            )
            self._write_back(token, logprob, out[step], self.tokens, self.positions, self.max_len)

    @staticmethod
    def _write_back_eager(
        token: torch.Tensor,
        logprob: torch.Tensor,
        out: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        max_len: int,
    ) -> None:
        """The step's results into the slots' state (one kernel when compiled)."""
        rows = token.shape[0]
        out[:, 0] = token.to(torch.float64)
        out[:, 1] = logprob.to(torch.float64)
        # Free slots keep counting too; the clamp keeps their (ignored) writes inside the cache.
        positions[:rows] = (positions[:rows] + 1).clamp(max=max_len - 1)
        tokens[:rows] = token

    def forward(self, rows: int, length: int) -> torch.Tensor:
        """Logits [rows, vocab] of slots [0, rows) fed their token at their position.

        Writes each slot's keys/values at its position; attends the first ``length`` cache
        positions (``length`` must exceed every position among the rows that matter).
        """
        tokens, positions = self.tokens[:rows], self.positions[:rows]
        hidden = F.embedding(tokens, self.embedding)
        cos, sin = self._rotary(positions)
        delta = self.no_delta[:rows]
        # Row of each new key/value in a layer's cache viewed as [2 * slots * kv_heads *
        # max_len, head_dim], in the order of new_kv below ([2, rows, kv_heads]); unused when
        # the attention kernel writes them.
        write_rows = (
            None
            if self.kv_write_in_attention
            else (self.kv_row_offsets[:, :rows] + positions[None, :, None]).reshape(-1)
        )
        layer = self._layer_writing_in_attention if self.kv_write_in_attention else self._layer
        for index, weights in enumerate(self.layers):
            hidden, delta = layer(
                index, weights, hidden, delta, positions, length, cos, sin, write_rows
            )
        return self._head(hidden, delta, self.final_norm, self.lm_head)

    def _layer_writing_in_attention(
        self,
        index: int,
        weights: LayerWeights,
        hidden: torch.Tensor,
        delta: torch.Tensor,
        positions: torch.Tensor,
        length: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_rows: None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer of the step, the attention kernel writing the new keys/values
        (KV_WRITE_IN_ATTENTION)."""
        rows = hidden.shape[0]
        hidden, q, k, v = self._qkv(
            hidden,
            delta,
            weights.input_norm,
            weights.qkv_weight,
            weights.qkv_bias,
            weights.q_norm,
            weights.k_norm,
        )
        attended = decode_attention(
            q, self.keys[index], self.values[index], positions, length, self.scale,
            cos, sin, new_k=k, new_v=v,
        )  # fmt: skip
        return self._out_mlp_step(
            hidden,
            attended.reshape(rows, self.heads * self.head_dim),
            weights.o_weight,
            weights.o_bias,
            weights.post_norm,
            weights.gate_up_weight,
            weights.down_weight,
        )

    def _layer(
        self,
        index: int,
        weights: LayerWeights,
        hidden: torch.Tensor,
        delta: torch.Tensor,
        positions: torch.Tensor,
        length: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer of the step, the new keys/values written at ``write_rows`` by the
        compiled kernel that rotates them."""
        hidden, q = self._attention_in(
            hidden,
            delta,
            weights.input_norm,
            weights.qkv_weight,
            weights.qkv_bias,
            weights.q_norm,
            weights.k_norm,
            cos,
            sin,
            self.cache[index].view(-1, self.head_dim),
            write_rows,
            rotate_q=not self.rope_in_attention,
        )
        return self._attention_out_mlp(
            hidden,
            q,
            self.keys[index],
            self.values[index],
            positions,
            length,
            cos if self.rope_in_attention else None,
            sin if self.rope_in_attention else None,
            weights.o_weight,
            weights.o_bias,
            weights.post_norm,
            weights.gate_up_weight,
            weights.down_weight,
        )

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary embedding at ``positions`` [n], as [n, 1, head_dim]."""
        angles = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos = (angles.cos() * self.rope_scaling).to(self.dtype)[:, None, :]
        sin = (angles.sin() * self.rope_scaling).to(self.dtype)[:, None, :]
        return cos, sin

    def _rms_norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        as_float = hidden.float()
        as_float = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * as_float.to(hidden.dtype)

    _rope = staticmethod(rotate_half)

    @staticmethod
    def _sum_parts(first: torch.Tensor | None, parts: torch.Tensor) -> torch.Tensor:
        """``first`` (None: nothing) plus the partial products ``parts`` [splits, ...] of a
        split projection, in float32. Unrolled adds (pointwise, so inductor fuses them into
        the kernel that consumes the sum) rather than a sum over the split dimension (a
        reduction kernel of its own)."""
        total: Any = first.float() if first is not None else 0.0
        for part in parts.unbind(0):
            total = total + part.float()
        return total

    @classmethod
    def _add_delta(cls, hidden: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Residual add of a layer's MLP output: [n, hidden], or [splits, n, hidden] partial
        sums of a split down projection (added in float32, rounded once)."""
        if delta.dim() == 3:
            return cls._sum_parts(hidden, delta).to(hidden.dtype)
        return hidden + delta

    def _attention_in_eager(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor,
        norm: torch.Tensor,
        qkv_weight: torch.Tensor,
        qkv_bias: torch.Tensor | None,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_rows: torch.Tensor,
        write_rows: torch.Tensor,
        rotate_q: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add, norm, QKV, rotary; the new keys/values ([2 * rows * kv_heads, dim])
        go into ``cache_rows`` (one layer's cache, flattened) at ``write_rows``, in the same
        kernel as the rotary embedding when compiled. ``rotate_q=False``: the queries are
        returned unrotated (the attention kernel rotates them)."""
        hidden, q, k, v = self._qkv_eager(hidden, delta, norm, qkv_weight, qkv_bias, q_norm, k_norm)
        new_kv = torch.stack([self._rope(k, cos, sin), v]).reshape(-1, self.head_dim)
        cache_rows.index_copy_(0, write_rows, new_kv)
        return hidden, self._rope(q, cos, sin) if rotate_q else q

    def _qkv_eager(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor,
        norm: torch.Tensor,
        qkv_weight: torch.Tensor,
        qkv_bias: torch.Tensor | None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual add, norm, QKV projection: the hidden state and the unrotated queries,
        keys and values ([rows, heads or kv_heads, dim], views of one fused output; with
        ``q_norm``/``k_norm`` the queries and keys RMS-normalised per head)."""
        rows = hidden.shape[0]
        hidden = self._add_delta(hidden, delta)
        normed = self._rms_norm(hidden, norm)
        if self.qkv_splits == 1:
            qkv = F.linear(normed, qkv_weight, qkv_bias)
        else:
            parts = self._split_linear(normed, qkv_weight, self.qkv_splits)
            qkv = self._sum_parts(qkv_bias, parts).to(hidden.dtype)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[:, :q_size].reshape(rows, self.heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(rows, self.kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(rows, self.kv_heads, self.head_dim)
        if q_norm is not None and k_norm is not None:
            q, k = self._rms_norm(q, q_norm), self._rms_norm(k, k_norm)
        return hidden, q, k, v

    def _attention_out_mlp_eager(
        self,
        hidden: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        length: int,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        o_weight: torch.Tensor,
        o_bias: torch.Tensor | None,
        post_norm: torch.Tensor,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        # One Triton kernel on CUDA, two batched products around a softmax elsewhere; with
        # cos/sin the queries are rotated there first.
        attended = decode_attention(q, keys, values, positions, length, self.scale, cos, sin)
        attended = attended.reshape(rows, self.heads * self.head_dim)
        return self._out_mlp(
            hidden, attended, o_weight, o_bias, post_norm, gate_up_weight, down_weight
        )

    def _out_mlp(
        self,
        hidden: torch.Tensor,
        attended: torch.Tensor,
        o_weight: torch.Tensor,
        o_bias: torch.Tensor | None,
        post_norm: torch.Tensor,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection and residual, norm, gate/up, SiLU, down (the MLP's delta).

        The residual add is written in float32 (the same single rounding to the model's dtype
        as a bf16 add): as a plain add, inductor folds it into the product (``addmm``), which
        first copies the residual into the output, one more kernel a layer.
        """
        if self.o_splits == 1:
            projected = F.linear(attended, o_weight, o_bias)
            hidden = (hidden.float() + projected.float()).to(hidden.dtype)
        else:
            parts = self._split_linear(attended, o_weight, self.o_splits)
            if o_bias is not None:
                hidden = (hidden.float() + o_bias.float()).to(hidden.dtype)
            hidden = self._add_delta(hidden, parts)
        gate, up = F.linear(self._rms_norm(hidden, post_norm), gate_up_weight).chunk(2, dim=-1)
        act = F.silu(gate) * up
        if self.down_splits == 1:
            return hidden, F.linear(act, down_weight)
        # The consumer (_add_delta, in the next layer or the head) sums the partial products.
        return hidden, self._split_linear(act, down_weight, self.down_splits)

    @staticmethod
    def _split_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
        """``F.linear(x, weight)`` as [splits, n, out] partial products over ``splits`` slices
        of the input features (one batched product; see DOWN_SPLITS)."""
        n, inner = x.shape
        part = inner // splits
        sliced = x.view(n, splits, part).transpose(0, 1)
        return torch.bmm(sliced, weight.view(weight.shape[0], splits, part).permute(1, 2, 0))

    def _prefill_in_eager(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``_attention_in`` over a prefill's tokens (its own compiled, dynamic-shape copy)."""
        return self._attention_in_eager(*args)  # type: ignore[arg-type]

    def _prefill_out_mlp_eager(
        self,
        hidden: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        o_weight: torch.Tensor,
        o_bias: torch.Tensor | None,
        post_norm: torch.Tensor,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of each row's tokens ([rows, kv_heads, width, dim] keys/values),
        then ``_out_mlp``."""
        rows, width = keys.shape[0], keys.shape[2]
        q = q.reshape(rows, width, self.heads, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=self.scale, enable_gqa=self.grouped_query
        )
        attended = attended.transpose(1, 2).reshape(rows * width, self.heads * self.head_dim)
        return self._out_mlp(
            hidden, attended, o_weight, o_bias, post_norm, gate_up_weight, down_weight
        )

    def _head_eager(
        self, hidden: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor
    ) -> torch.Tensor:
        return F.linear(self._rms_norm(self._add_delta(hidden, delta), norm), lm_head)

    def _vocab_blocks_eager(
        self, logits: torch.Tensor, temperatures: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass over the logits: log-normaliser, per-block probability mass, argmax."""
        tempered = logits.float() / temperatures[:, None]
        log_norm = torch.logsumexp(tempered, dim=-1, keepdim=True)
        padding = -tempered.shape[-1] % SAMPLE_BLOCK
        padded = F.pad(tempered, (0, padding), value=float("-inf"))
        masses = (padded - log_norm).exp().view(tempered.shape[0], -1, SAMPLE_BLOCK).sum(-1)
        return log_norm, masses, logits.argmax(dim=-1)

    def _sample_tokens(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        greedy: torch.Tensor,
        uniforms: torch.Tensor,
        top_p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse-CDF draw of the tempered distribution (the torch engine's sampler).

        Without top-p, the CDF is found in two levels, so no full-vocabulary cumulative sum
        is ever written: block masses (one fused pass), the block holding ``u x total`` mass,
        then the token inside that block. The result is the plain inverse CDF up to the
        summation order of the float32 masses. On CUDA the same draw is one Triton kernel
        (``decode_sampler.py``: two walks over each row, no [rows, vocab] float32 tensor).
        """
        if top_p is not None:
            return _sample_sorted(logits, temperatures, greedy, uniforms, top_p)
        if decode_sampler.kernel_available(logits):  # the same draw as one Triton kernel
            return decode_sampler.sample_rows(logits, temperatures, greedy, uniforms)
        log_norm, masses, argmax = self._vocab_blocks(logits, temperatures)
        vocab = logits.shape[1]
        block_cdf = masses.cumsum(dim=-1)
        target = uniforms[:, None] * block_cdf[:, -1:]
        block = torch.searchsorted(block_cdf, target, right=True).clamp(max=masses.shape[1] - 1)
        before = block_cdf.gather(1, block) - masses.gather(1, block)
        columns = block * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=logits.device)
        inside = logits.gather(1, columns.clamp(max=vocab - 1)).float() / temperatures[:, None]
        inside = (inside - log_norm).exp().masked_fill(columns >= vocab, 0.0)
        offset = torch.searchsorted(inside.cumsum(dim=-1), target - before, right=True)
        picks = (block * SAMPLE_BLOCK + offset.clamp(max=SAMPLE_BLOCK - 1)).clamp(max=vocab - 1)
        tokens = torch.where(greedy[:, None], argmax[:, None], picks)
        chosen = logits.gather(1, tokens).float() / temperatures[:, None] - log_norm
        return tokens[:, 0], chosen[:, 0]


def _sample_sorted(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's top-p sampler: inverse CDF over the sorted, truncated distribution."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    sorted_probs, order = logprobs.exp().sort(dim=-1, descending=True)
    outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    cdf = sorted_probs.masked_fill(outside, 0.0).cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)
    picks = order.gather(1, picks.clamp(max=cdf.shape[-1] - 1))
    tokens = torch.where(greedy[:, None], logits.argmax(dim=-1, keepdim=True), picks)
    return tokens[:, 0], logprobs.gather(1, tokens)[:, 0]
