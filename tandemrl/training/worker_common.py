"""Pieces the policy and value workers share: optimizer and scheduler, mixed precision,
optimizer-state offload, the split-step bookkeeping, and checkpoint sidecar files.

A worker's public methods are ``async`` (the trainer contract) but their work is plain
blocking torch code. ``SerialExecutor.run`` runs it in a worker thread, one call at a time, so
that an in-process caller's event loop (the controller's two pumps) keeps turning while a
train step runs, and a Ray actor keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

from tandemrl.config.models import OptimizerConfig, SchedulerConfig
from tandemrl.heap import HeapTrimmer
from tandemrl.sm_partition import SmShare
from tandemrl.training.losses import AllMaskedStepError
from tandemrl.training.shard_adamw import ShardLocalAdamW, local_part

T = TypeVar("T")

OPTIMIZER_FILE = "optimizer.pt"
WORKER_STATE_FILE = "worker_state.json"
CHECKPOINT_FORMAT = 1
# worker_state.json "layout" of a folder written by the ranks of a sharded trainer
# (``tandemrl.training.fsdp``); absent: one process's save_pretrained folder.
SHARDED_LAYOUT = "dcp"


class CheckpointError(RuntimeError):
    """A trainer checkpoint file is missing, unreadable or does not match the worker."""


class TrainStepError(RuntimeError):
    """The split train API was driven out of order, or a step's inputs are inconsistent."""


class SerialExecutor:
    """Runs blocking calls in a thread, one at a time (a lock guards the model).

    With ``sm_share`` (``tandemrl.sm_partition``) each call queues its CUDA work on the share's
    stream, so the kernels run on the share's SMs only, and waits for that stream before it
    returns: what the call wrote is then ready for every stream of the process (an engine
    beside the trainer reads the weights it is sent on a stream of its own).
    """

    def __init__(self, sm_share: SmShare | None = None) -> None:
        self._lock = threading.Lock()
        self.sm_share = sm_share

    def _locked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._lock:
            share = self.sm_share
            if share is None:
                return fn(*args, **kwargs)
            previous = share.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                share.stream.synchronize()
                torch.cuda.set_stream(previous)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(self._locked, fn, *args, **kwargs)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype for ``policy.precision``; parameters stay float32 (the master copy).

    "auto": bfloat16 autocast on CUDA, plain float32 on CPU.
    """
    if precision == "float32":
        return None
    if precision == "bfloat16":
        return torch.bfloat16
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    raise ValueError(f"unknown precision {precision!r}; use auto, float32 or bfloat16")


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW from the config; torch's fused kernel on CUDA and CPU.

    On CPU the fused step of the default tiny model (26 tensors, 0.5 M parameters) takes
    0.66 ms against 1.92 ms for the per-tensor loop (one thread, torch 2.13). Parameters an
    FSDP2 rank holds as DTensors get ``ShardLocalAdamW``, the same update run on their local
    shards (``shard_adamw.py``).
    """
    params = list(params)
    sharded = any(isinstance(p, DTensor) for p in params)
    optimizer_class = ShardLocalAdamW if sharded else torch.optim.AdamW
    return optimizer_class(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=device.type in ("cuda", "cpu"),
    )


class WarmupFactor:
    """lr multiplier over the first ``warmup_steps`` steps, then 1.

    Without ``start_factor``: (step + 1) / warmup_steps, so the first optimizer step uses
    lr / warmup_steps and step ``warmup_steps - 1`` the full lr. With it (torch's LinearLR,
    what NeMo-RL's configs use): start_factor + (1 - start_factor) * step / warmup_steps,
    so the first step uses start_factor x lr and step ``warmup_steps`` the full lr.
    A class (not a lambda) so that the scheduler pickles.
    """

    def __init__(self, warmup_steps: int, start_factor: float | None = None) -> None:
        self.warmup_steps = warmup_steps
        self.start_factor = start_factor

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        if self.start_factor is None:
            return min(1.0, (step + 1) / self.warmup_steps)
        progress = min(1.0, step / self.warmup_steps)
        return self.start_factor + (1.0 - self.start_factor) * progress


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig | None
) -> torch.optim.lr_scheduler.LambdaLR:
    if cfg is None or cfg.name != "linear_warmup":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupFactor(0))
    factor = WarmupFactor(cfg.warmup_steps, cfg.start_factor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


TRANSITIONS_KEPT = 64


class OptimizerOffload:
    """Moves an optimizer's state between the accelerator and host memory.

    On CUDA, ``offload`` copies every state tensor to CPU and frees the device copy;
    ``reload`` moves it back next to the parameters. On CPU there is nothing to move: both
    calls only record the transition (``location`` and ``transitions``), so the phase logic
    is exercised and observable in CPU tests without pretending that memory was freed.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self.location = "device"
        # The latest transitions (two a step on a colocated run: bounded on long runs).
        self.transitions: deque[str] = deque(maxlen=TRANSITIONS_KEPT)

    def _move(self, target: torch.device) -> None:
        # Sharded parameters' states are DTensors: ``.to`` moves each rank's own shard.
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # AdamW keeps "step" on CPU unless fused/capturable: leave it where it is.
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.to(target, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def offload(self) -> None:
        if self.location == "cpu":
            return
        if self.device.type == "cuda":
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()
        self.location = "cpu"
        self.transitions.append("offload")

    def reload(self) -> None:
        if self.location == "device":
            return
        if self.device.type == "cuda":
            self._move(self.device)
        self.location = "device"
        self.transitions.append("reload")


class StepTracker:
    """Bookkeeping of one split RL step: begin -> chunks -> finish.

    Normalization of a step that arrives in chunks, two ways:

    - ``step_num_tokens`` given (the caller knows the whole step up front: N valid tokens in
      ``step_num_sequences`` rows): every micro-batch loss is its token sum / N (token mean)
      or its sequences' means / ``step_num_sequences`` (sequence mean), gradients accumulate
      to exactly the unsplit step's; ``finish`` checks that the chunks really held N tokens
      in ``step_num_sequences`` rows.
    - ``step_num_tokens`` None (streaming: chunks are trained as they arrive and the step's
      size is not known yet): ``step_num_sequences`` is a provisional constant shared by all
      chunks (the step as planned; a dropped prompt may leave it fewer rows). Every
      micro-batch loss is its token sum, or its sequences' means, / that constant, and
      ``finish`` multiplies the accumulated gradient by constant / N (token mean) or
      constant / the rows the chunks held (sequence mean) before clipping. Gradients are
      linear in the loss, so the result is the mean over the rows the step actually trained.

    ``begin`` refuses a step already open and ``require_active`` a call outside one (the
    fake trainer runs the same checks). Also aggregates the per-micro-batch metrics
    (token-weighted means, maxima, sums).
    """

    MAX_KEYS = ("is_weight_max",)
    SUM_KEYS = ("loss", "value_loss", "num_tokens")

    def __init__(self) -> None:
        self.active = False
        self.reset()

    def reset(self) -> None:
        self.chunks = 0
        self.valid_tokens = 0
        self.sequences = 0  # rows of every chunk, sample_mask 0 included (they count too)
        self.declared_tokens: int | None = None
        self.declared_sequences: int | None = None
        self.deferred: bool | None = None
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}

    def begin(self) -> None:
        if self.active:
            raise TrainStepError(
                "begin_train_step called while a step is open; call finish_train_step first"
            )
        self.reset()
        self.active = True

    def end(self) -> None:
        """The step is over (applied, or refused by ``check_finish``)."""
        self.active = False

    def require_active(self, what: str) -> None:
        if not self.active:
            raise TrainStepError(f"{what} called outside a train step: call begin_train_step first")

    def declare(
        self, *, step_num_sequences: int, step_num_tokens: int | None, num_sequences: int
    ) -> int:
        """Record one chunk's declared step sizes and its ``num_sequences`` rows; returns the
        token normalizer to use."""
        self.require_active("train_microbatches")
        if step_num_sequences <= 0:
            raise TrainStepError(f"step_num_sequences must be positive, got {step_num_sequences}")
        deferred = step_num_tokens is None
        if self.deferred is not None and self.deferred != deferred:
            raise TrainStepError("pass step_num_tokens to every chunk of a step or to none of them")
        if step_num_tokens is not None and step_num_tokens <= 0:
            raise AllMaskedStepError(
                "every completion of this RL step is masked out (step_num_tokens is 0): "
                "there is nothing to train on"
            )
        for name, value, previous in (
            ("step_num_tokens", step_num_tokens, self.declared_tokens),
            ("step_num_sequences", step_num_sequences, self.declared_sequences),
        ):
            if previous is not None and previous != value:
                raise TrainStepError(
                    f"{name} changed within one step ({previous} then {value}); every chunk "
                    "of a step must pass the whole step's count"
                )
        self.deferred = deferred
        self.declared_tokens = step_num_tokens
        self.declared_sequences = step_num_sequences
        self.chunks += 1
        self.sequences += num_sequences
        return step_num_sequences if step_num_tokens is None else step_num_tokens

    def add(self, metrics: dict[str, float]) -> None:
        tokens = metrics.get("num_tokens", 0.0)
        self.valid_tokens += int(tokens)
        for key, value in metrics.items():
            if key in self.MAX_KEYS:
                self._sums[key] = max(self._sums.get(key, -math.inf), value)
            elif key in self.SUM_KEYS:
                self._sums[key] = self._sums.get(key, 0.0) + value
            else:
                self._sums[key] = self._sums.get(key, 0.0) + value * tokens
                self._weights[key] = self._weights.get(key, 0.0) + tokens

    def gradient_scale(
        self, token_level: bool, valid_tokens: int | None = None, sequences: int | None = None
    ) -> float:
        """Factor ``finish`` applies to the accumulated gradient (and summed loss metrics):
        the provisional normalizer of a deferred step over the step's real token (token mean)
        or row (sequence mean) count; 1 when the caller passed the step's counts.

        ``valid_tokens`` / ``sequences``: the step's counts over every rank of a sharded
        trainer (default: what this tracker saw)."""
        if not self.deferred:
            return 1.0
        assert self.declared_sequences is not None
        if token_level:
            actual = self.valid_tokens if valid_tokens is None else valid_tokens
        else:
            actual = self.sequences if sequences is None else sequences
        return self.declared_sequences / actual

    def summary(self, scale: float = 1.0) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in self._sums.items():
            if key in self._weights:
                weight = self._weights[key]
                out[key] = value / weight if weight > 0 else 0.0
            elif key in ("loss", "value_loss"):
                out[key] = value * scale
            else:
                out[key] = value
        out["num_chunks"] = float(self.chunks)
        return out

    def check_finish(self, valid_tokens: int | None = None, sequences: int | None = None) -> None:
        """``valid_tokens`` / ``sequences``: the step's counts over every rank (default: this
        tracker's)."""
        self.require_active("finish_train_step")
        if valid_tokens is None:
            valid_tokens = self.valid_tokens
        if sequences is None:
            sequences = self.sequences
        if valid_tokens == 0:
            raise AllMaskedStepError(
                "every completion of this RL step is masked out (no chunk held a token with "
                "token_mask x sample_mask = 1): refusing to apply an empty optimizer step"
            )
        if self.declared_tokens is not None and self.declared_tokens != valid_tokens:
            raise TrainStepError(
                f"the step's chunks held {valid_tokens} valid tokens but step_num_tokens "
                f"was {self.declared_tokens}: the loss was normalized by the wrong count "
                "(a chunk is missing, or the count ignored sample_mask)"
            )
        if self.declared_tokens is not None and self.declared_sequences != sequences:
            raise TrainStepError(
                f"the step's chunks held {sequences} sequences but step_num_sequences was "
                f"{self.declared_sequences}: a sequence-mean loss was normalized by the wrong "
                "count (pass the rows the step holds, or step_num_tokens=None to defer)"
            )


def scale_gradients(params: Iterable[torch.nn.Parameter], scale: float) -> None:
    if scale == 1.0:
        return
    # One foreach kernel over the local parts: a DTensor gradient's mul_ per parameter costs
    # DTensor's dispatch 290 times a step for the 0.5B model.
    with torch.no_grad():
        grads = [local_part(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale)


def grad_norm_and_clip(params: Iterable[torch.nn.Parameter], max_grad_norm: float | None) -> float:
    """Total gradient norm before clipping; clips to ``max_grad_norm`` when set.

    A non-finite norm raises: stepping on it would write NaNs into every weight.
    """
    params = [p for p in params if p.grad is not None]
    limit = max_grad_norm if max_grad_norm is not None else math.inf
    norm = float(torch.nn.utils.clip_grad_norm_(params, limit).item()) if params else 0.0
    if not math.isfinite(norm):
        raise FloatingPointError(
            f"gradient norm is {norm}; refusing the optimizer step (lower the lr, check the "
            "advantages and logprobs for inf/NaN)"
        )
    return norm


def write_worker_state(directory: Path, state: dict[str, Any]) -> None:
    payload = {"format": CHECKPOINT_FORMAT, **state}
    (directory / WORKER_STATE_FILE).write_text(json.dumps(payload, sort_keys=True) + "\n")


def read_worker_state(directory: Path) -> dict[str, Any]:
    path = directory / WORKER_STATE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file {path} is missing; {directory} is not a worker checkpoint"
        )
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {path} is unreadable: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint file {path} has format {state.get('format') if isinstance(state, dict) else state!r}, "
            f"expected {CHECKPOINT_FORMAT}"
        )
    return state


def save_optimizer_state(
    directory: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
        directory / OPTIMIZER_FILE,
    )


def load_optimizer_state(
    directory: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    path = directory / OPTIMIZER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file {path} is missing: the checkpoint was saved without optimizer "
            "state (checkpointing.save_optimizer: false); load it with load_optimizer=False"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(payload, dict) or {"optimizer", "scheduler"} - payload.keys():
            raise CheckpointError("expected a dict with 'optimizer' and 'scheduler' entries")
        optimizer.load_state_dict(payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt or does not match: {exc}"
        ) from exc


HEAP_TRIM_INTERVAL_S = 30.0


class SplitStepWorkerAPI:
    """The async face shared by the policy and value workers: each call runs the worker's
    synchronous ``_name`` method on its serial executor, so the caller's event loop (or the
    Ray actor's) keeps serving while a step computes."""

    _executor: SerialExecutor
    _step: StepTracker
    optimizer: torch.optim.Optimizer
    _heap_trimmer: HeapTrimmer | None = None

    def _begin_train_step(self) -> None:
        self._step.begin()
        self.optimizer.zero_grad(set_to_none=True)

    async def begin_train_step(self) -> None:
        await self._executor.run(self._begin_train_step)

    async def train_microbatches(
        self,
        batch: dict[str, torch.Tensor],
        *,
        step_num_sequences: int,
        step_num_tokens: int | None = None,
    ) -> dict[str, float]:
        """Accumulate ``batch``'s share of the step's gradient (see the worker's docstring)."""
        return await self._executor.run(
            self._train_microbatches,  # type: ignore[attr-defined]
            batch,
            step_num_sequences,
            step_num_tokens,
        )

    async def finish_train_step(self) -> dict[str, float]:
        """Exactly one optimizer step; metrics include grad_norm, lr and optimizer_steps."""
        metrics = await self._executor.run(self._finish_train_step)  # type: ignore[attr-defined]
        # A long run's trainer frees as much as it allocates, and glibc keeps the freed pages
        # unless asked (tandemrl.heap): every HEAP_TRIM_INTERVAL_S, between steps.
        if self._heap_trimmer is None:
            self._heap_trimmer = HeapTrimmer(HEAP_TRIM_INTERVAL_S)
        self._heap_trimmer.maybe_trim()
        return metrics

    async def save_checkpoint(self, directory: Path, *, save_optimizer: bool) -> None:
        await self._executor.run(self._save_checkpoint, Path(directory), save_optimizer)  # type: ignore[attr-defined]

    async def load_checkpoint(self, directory: Path, *, load_optimizer: bool) -> None:
        await self._executor.run(self._load_checkpoint, Path(directory), load_optimizer)  # type: ignore[attr-defined]

    async def get_state(self) -> dict[str, Any]:
        return await self._executor.run(self.state)  # type: ignore[attr-defined]
