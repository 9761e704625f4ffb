"""The sharded trainer as one trainer: a Ray actor per rank, and the handle that fans out to them.

``policy.dtensor_cfg.data_parallel_size`` N > 1 runs the policy trainer (and the PPO critic) as
N ranks (``tandemrl.training.sharded_workers``), one ``TrainerRankActor`` each. The controller
calls one ``ShardedTrainer``, which implements the same ``Trainer`` / ``ValueTrainer`` contract
as the unsharded worker:

- ``get_logprobs`` / ``get_values`` / ``train_microbatches``: the batch's rows are split across
  the ranks by tokens (``split_rows_by_tokens``: longest rows first, each to the rank with the
  fewest tokens so far); every rank gets the whole step's ``step_num_sequences`` /
  ``step_num_tokens``; a rank without rows gets ``None`` and only takes the passes the others
  need. Logprobs and values come back in the batch's row order.
- ``begin_train_step`` / ``finish_train_step`` / checkpoints / the final model: every rank.
  A split-step call out of order (a finish without a begin, ...) is refused here with the
  unsharded worker's ``TrainStepError``, before any rank sees it.
  Metrics are merged (``merge_metrics``): summed losses and token counts, token-weighted means,
  maxima; grad norm and lr are the same on every rank.
- ``export_weights_flat_refs``: the full weights, gathered one tensor at a time, as rank 0's
  object reference (handed to the generation workers as it is, so the weights go from rank 0
  to them without passing through the controller).

Ordering. FSDP2's collectives must be issued in the same order on every rank. Each call carries
a sequence number, and a rank runs its calls in that order on one thread (its calls never
overlap); calls from one caller (the driver before the run, the controller during it, the
driver again for the final model) form one sequence each.

Failures. A call waits for every rank. When one fails, the others get ``RANK_FAILURE_GRACE_S``
to report too (a rank whose peer died fails its collective soon after), and the error names the
rank that failed first — a rank whose process died before one whose collective merely broke —
as ``policy trainer rank 1 of 2 died ...``. The controller then fails the run; a restart
resumes from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tandemrl.training.api import TrainBatch
from tandemrl.training.worker_common import TrainStepError

log = logging.getLogger(__name__)

# After the first failed rank, how long the others may take to report (seconds).
RANK_FAILURE_GRACE_S = 3.0
# Metrics a step's ranks add up, keep the largest of, or share.
SUMMED_METRICS = ("loss", "value_loss", "num_tokens", "process_cpu_s")
MAX_METRICS = ("is_weight_max", "num_chunks")
SHARED_METRICS = ("grad_norm", "lr", "optimizer_steps")


class TrainerRankError(RuntimeError):
    """A rank of a sharded trainer died or failed; the message names it."""


def row_tokens(batch: TrainBatch) -> list[int]:
    """Real tokens of each row (what a row costs to train)."""
    return [int(n) for n in batch["attention_mask"].sum(dim=1).tolist()]


def split_rows_by_tokens(token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Row indices per rank, balanced by tokens: rows longest first, each to the rank with the
    fewest tokens so far (the lowest rank on ties); each rank's rows in batch order."""
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    order = sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i))
    for index in order:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += token_counts[index]
    return [sorted(share) for share in shares]


def take_rows(batch: TrainBatch, rows: list[int]) -> TrainBatch | None:
    """The sub-batch of ``rows`` (None when empty); fields without the batch dimension are
    shared."""
    if not rows:
        return None
    size = batch["input_ids"].shape[0]
    index = torch.tensor(rows, dtype=torch.long)
    return {
        key: value.index_select(0, index) if value.dim() > 0 and value.shape[0] == size else value
        for key, value in batch.items()
    }


def merge_metrics(per_rank: Sequence[dict[str, float]], *, mean_loss: bool) -> dict[str, float]:
    """One metrics dict from every rank's: sums, maxima, shared values, and token-weighted
    means of the rest. ``mean_loss``: the ranks' losses are token means of their own rows (a
    chunk's summary of a token-level loss), merged as a token-weighted mean, not a sum."""
    tokens = [row.get("num_tokens", 0.0) for row in per_rank]
    total_tokens = sum(tokens)
    keys = dict.fromkeys(key for row in per_rank for key in row)
    out: dict[str, float] = {}
    for key in keys:
        values = [
            (row[key], weight) for row, weight in zip(per_rank, tokens, strict=True) if key in row
        ]
        if key in SHARED_METRICS:
            out[key] = values[0][0]
        elif key in MAX_METRICS:
            out[key] = max(value for value, _ in values)
        elif key in SUMMED_METRICS and not (mean_loss and key in ("loss", "value_loss")):
            out[key] = sum(value for value, _ in values)
        else:
            weight = sum(w for _, w in values)
            out[key] = sum(v * w for v, w in values) / weight if weight > 0 else 0.0
    if "num_tokens" in keys:
        out["num_tokens"] = total_tokens
    return out


# ---------------------------------------------------------------------------- the rank actor


class TrainerRankActor:
    """One rank as a Ray actor: joins the group, builds its worker, runs calls in order.

    ``call(caller, seq, method, *args)`` runs the worker's synchronous ``method`` on the
    rank's single work thread once every earlier call of ``caller`` has been handed to it, so
    calls run in sequence order (see the module docstring). The actor's own event loop stays
    free, so it answers while a call computes.
    """

    def __init__(self, kind: str, rank: int, world_size: int, timeout_s: float) -> None:
        torch.set_num_threads(1)
        logging.basicConfig(level=logging.INFO)
        self.kind = kind
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.worker: Any = None
        self._store: Any = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"rank{rank}")
        self._next: dict[str, int] = {}
        self._turns = asyncio.Condition()

    async def ping(self) -> int:
        return os.getpid()

    async def open_rendezvous(self, backend: str) -> Any:
        """Rank 0: open the store the group meets at; returns its ``RankGroupAddress``."""
        from tandemrl.training.rank_group import open_rank_rendezvous

        self._store, address = open_rank_rendezvous(self.world_size, self.timeout_s, backend)
        return address

    async def start(self, address: Any, worker_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Join the group and build this rank's worker (blocks until every rank joined)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._thread, functools.partial(self._start, address, worker_kwargs)
        )

    def _start(self, address: Any, worker_kwargs: dict[str, Any]) -> dict[str, Any]:
        from tandemrl.training.rank_group import join_rank_group
        from tandemrl.training.sharded_workers import ShardedPolicyWorker, ShardedValueWorker

        device = torch.device("cuda", 0) if address.backend == "nccl" else torch.device("cpu")
        join_rank_group(address, self.rank, store=self._store, device=device)
        worker_class = ShardedPolicyWorker if self.kind == "policy" else ShardedValueWorker
        self.worker = worker_class(**worker_kwargs)
        return dict(self.worker.state())

    async def call(self, caller: str, seq: int, method: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        async with self._turns:
            await self._turns.wait_for(lambda: self._next.get(caller, 0) == seq)
            future = loop.run_in_executor(
                self._thread, functools.partial(getattr(self.worker, method), *args)
            )
            self._next[caller] = seq + 1
            self._turns.notify_all()
        return await future

    async def call_export(self, caller: str, seq: int) -> tuple[str, Any]:
        """``call`` of the weight export, as two return values (called with
        ``num_returns=2``): a status the caller waits for, and the weights (rank 0) handed on
        unread."""
        return "ok", await self.call(caller, seq, "_export_weights_flat")


def create_rank_actor(
    kind: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    *,
    num_cpus: float,
    num_gpus: float,
    **options: Any,
) -> Any:
    import ray

    return (
        ray.remote(TrainerRankActor)
        .options(num_cpus=num_cpus, num_gpus=num_gpus, **options)
        .remote(kind, rank, world_size, timeout_s)
    )


# ---------------------------------------------------------------------------- the one trainer


class ShardedTrainer:
    """The ``Trainer`` (``role`` "policy trainer") or ``ValueTrainer`` ("critic") over the
    rank actors ``ranks`` (see the module docstring)."""

    def __init__(self, ranks: list[Any], *, role: str, token_level_loss: bool = True) -> None:
        self.ranks = list(ranks)
        self.role = role
        self.token_level_loss = token_level_loss
        self._caller = uuid.uuid4().hex
        self._seq = 0
        # Whether a split step is open on the ranks: a call out of order is refused here,
        # before it reaches them, with the error one process gives (not as a rank failure).
        self._step_open = False

    def __getstate__(self) -> dict[str, Any]:
        # A copy in another process is another caller with a sequence of its own.
        return {"ranks": self.ranks, "role": self.role, "token_level_loss": self.token_level_loss}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(
            state["ranks"], role=state["role"], token_level_loss=state["token_level_loss"]
        )  # type: ignore[misc]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def _next_seq(self) -> int:
        seq, self._seq = self._seq, self._seq + 1
        return seq

    def _refs(self, method: str, per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        seq = self._next_seq()
        return [
            rank.call.remote(self._caller, seq, method, *args)
            for rank, args in zip(self.ranks, per_rank, strict=True)
        ]

    # -------------------------------------------------------------- waiting, naming the rank

    def _rank_error(self, what: str, failures: dict[int, BaseException]) -> TrainerRankError:
        from ray.exceptions import RayActorError

        died = [rank for rank, exc in failures.items() if isinstance(exc, RayActorError)]
        rank = died[0] if died else min(failures)
        exc = failures[rank]
        how = "died (its process exited)" if died else "failed"
        others = sorted(set(failures) - {rank})
        also = f"; rank(s) {others} failed after it" if others else ""
        return TrainerRankError(
            f"{self.role} rank {rank} of {self.world_size} {how} during {what}{also}: "
            f"{type(exc).__name__}: {exc}"
        )

    async def _gather(self, refs: list[Any], what: str) -> list[Any]:
        async def one(ref: Any) -> Any:
            return await ref

        tasks = [asyncio.ensure_future(one(ref)) for ref in refs]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if pending and any(task.exception() is not None for task in done):
            more, pending = await asyncio.wait(pending, timeout=RANK_FAILURE_GRACE_S)
            done |= more
        failures = {
            index: task.exception()
            for index, task in enumerate(tasks)
            if task in done and task.exception() is not None
        }
        for task in pending:
            task.cancel()
        if failures:
            raise self._rank_error(what, failures)  # type: ignore[arg-type]
        return [task.result() for task in tasks]

    def gather_blocking(self, refs: list[Any], what: str) -> list[Any]:
        """``_gather`` for a caller outside an event loop (the driver)."""
        import ray

        pending = list(refs)
        failures: dict[int, BaseException] = {}
        deadline: float | None = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                break  # grace over
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:
                    failures[refs.index(ref)] = exc
                    if deadline is None:
                        deadline = time.monotonic() + RANK_FAILURE_GRACE_S
        if failures:
            raise self._rank_error(what, failures)
        return ray.get(refs)

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return await self._gather(self._refs(method, [args] * self.world_size), method)

    async def _split(
        self, method: str, batch: TrainBatch, *args: Any
    ) -> tuple[list[list[int]], list[Any]]:
        shares = split_rows_by_tokens(row_tokens(batch), self.world_size)
        per_rank = [(take_rows(batch, rows), *args) for rows in shares]
        results = await self._gather(self._refs(method, per_rank), method.lstrip("_"))
        return shares, results

    async def _rows_back(self, method: str, batch: TrainBatch, *args: Any) -> torch.Tensor:
        shares, results = await self._split(method, batch, *args)
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for rows, values in zip(shares, results, strict=True):
            if rows:
                out[torch.tensor(rows, dtype=torch.long)] = values
        return out

    # -------------------------------------------------------------- driver side (blocking)

    def start(self, worker_kwargs: dict[str, Any], backend: str) -> list[dict[str, Any]]:
        """Rendezvous at rank 0's store, join every rank and build its worker."""
        import ray

        address = ray.get(self.ranks[0].open_rendezvous.remote(backend))
        refs = [rank.start.remote(address, worker_kwargs) for rank in self.ranks]
        return self.gather_blocking(refs, "start-up")

    def save_final_model_blocking(self, directory: str) -> str:
        refs = self._refs("_save_final_model", [(Path(directory),)] * self.world_size)
        return str(self.gather_blocking(refs, "saving the final model")[0])

    # -------------------------------------------------------------- the trainer contract

    async def get_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return await self._rows_back("_get_logprobs", batch)

    async def get_reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return await self._rows_back("_get_logprobs", batch, True)

    async def get_values(self, batch: TrainBatch) -> torch.Tensor:
        return await self._rows_back("_get_values", batch)

    def _require_step(self, what: str) -> None:
        if not self._step_open:
            raise TrainStepError(f"{what} called outside a train step: call begin_train_step first")

    async def begin_train_step(self) -> None:
        if self._step_open:
            raise TrainStepError(
                "begin_train_step called while a step is open; call finish_train_step first"
            )
        await self._all("_begin_train_step")
        self._step_open = True

    async def train_microbatches(
        self, batch: TrainBatch, *, step_num_sequences: int, step_num_tokens: int | None = None
    ) -> dict[str, float]:
        self._require_step("train_microbatches")
        _, results = await self._split(
            "_train_microbatches", batch, step_num_sequences, step_num_tokens
        )
        return merge_metrics(results, mean_loss=self.token_level_loss)

    async def finish_train_step(self) -> dict[str, float]:
        self._require_step("finish_train_step")
        # Closed whatever the ranks answer: each ends its step, applied or refused.
        self._step_open = False
        return merge_metrics(await self._all("_finish_train_step"), mean_loss=False)

    async def save_checkpoint(self, directory: Path, *, save_optimizer: bool) -> None:
        await self._all("_save_checkpoint", Path(directory), save_optimizer)

    async def load_checkpoint(self, directory: Path, *, load_optimizer: bool) -> None:
        await self._all("_load_checkpoint", Path(directory), load_optimizer)

    async def load_warm_start(self, checkpoint_dir: Path) -> None:
        await self._all("_load_warm_start", Path(checkpoint_dir))

    async def save_final_model(self, directory: str) -> str:
        return str((await self._all("_save_final_model", Path(directory)))[0])

    async def offload_optimizer(self) -> None:
        await self._all("_offload_optimizer")

    async def reload_optimizer(self) -> None:
        await self._all("_reload_optimizer")

    async def get_state(self) -> dict[str, Any]:
        return dict((await self._all("state"))[0])

    def export_weights_flat_refs(self) -> tuple[Any, list[Any]]:
        """(rank 0's reference to the full ``FlatWeights``, every rank's status reference);
        wait for the statuses (``wait_exported``) before handing the weights on."""
        seq = self._next_seq()
        pairs = [
            rank.call_export.options(num_returns=2).remote(self._caller, seq) for rank in self.ranks
        ]
        return pairs[0][1], [status for status, _ in pairs]

    async def wait_exported(self, statuses: list[Any]) -> None:
        await self._gather(statuses, "the weight export")
