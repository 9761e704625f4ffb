"""One rank of a sharded policy trainer or critic: the unsharded worker, with FSDP2.

``ShardedPolicyWorker`` and ``ShardedValueWorker`` are the ``PolicyWorker`` and ``ValueWorker``
of one rank of the trainer group (``tandemrl.training.trainer_group`` fans the controller's
calls out to the ranks). The rank joins its group first (``rank_group.join_rank_group``); the
worker then builds the model as the unsharded one does and shards it before the optimizer is
built (``fsdp.shard_model``: every decoder layer, then the root: ``PolicyForward`` /
``CriticModel``). Everything else is the unsharded worker's own code, which asks
``self.replicas`` where a step depends on the other ranks (``rank_group.Replicas``):

- each rank trains the rows it is given; the number of passes is agreed first and a rank with
  fewer micro-batches takes idle passes, so FSDP2's collectives line up;
- the token-mean loss divides by the step's token count over every rank (given up front, or
  all-reduced in ``finish_train_step`` when chunks stream; a sequence mean likewise by the
  step's rows over every rank), and FSDP2 sums the gradients, so a
  step at N ranks is the step at one rank up to float rounding;
- the gradient norm is taken over every rank's shards (one all-reduce) and clipping applies the
  same coefficient everywhere; every rank then takes exactly one optimizer step.

What differs: weights and checkpoints. ``_export_weights_flat`` gathers full tensors one at a
time (rank 0 keeps them, ``fsdp.gather_flat_weights``); ``_save_checkpoint`` writes the DCP
folder (``fsdp.save_sharded_checkpoint``); ``_load_checkpoint`` reads a DCP folder written at
any number of ranks, or one process's folder (full tensors, sharded on load).
``_save_final_model`` gathers the full model to rank 0, which writes the transformers folder.
A row batch of ``None`` means "no rows for this rank in this call": the rank only takes the
passes the others need.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tandemrl.config.models import LossConfig, PolicyConfig, ValueConfig, ValueLossConfig
from tandemrl.dataplane.atomic import atomic_directory
from tandemrl.training.api import TrainBatch
from tandemrl.training.fsdp import (
    gather_flat_weights,
    gather_full_state_dict,
    load_full_into_sharded,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    shard_model,
    sharded_grad_norm_and_clip,
)
from tandemrl.training.policy_worker import PolicyWorker, copy_tokenizer_files
from tandemrl.training.rank_group import GroupReplicas
from tandemrl.training.value_worker import ValueWorker
from tandemrl.training.worker_common import (
    OPTIMIZER_FILE,
    SHARDED_LAYOUT,
    CheckpointError,
    StepTracker,
    read_worker_state,
    write_worker_state,
)
from tandemrl.transport.object_store import FlatWeights


def _decoder_layers(model: torch.nn.Module, what: str) -> torch.nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"policy.dtensor_cfg.data_parallel_size > 1 shards {what} per decoder layer, but "
            f"{type(model).__name__} keeps no .layers; set data_parallel_size: 1"
        )
    return layers


def _reshard_after_forward(setting: bool | None, world_size: int) -> bool:
    """``policy.dtensor_cfg.reshard_after_forward``; None: only when there are other ranks."""
    return world_size > 1 if setting is None else setting


def _read_optimizer_file(directory: Path) -> dict[str, Any]:
    path = directory / OPTIMIZER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file {path} is missing: the checkpoint was saved without optimizer "
            "state (checkpointing.save_optimizer: false); load it with load_optimizer=False"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from exc
    if not isinstance(payload, dict) or {"optimizer", "scheduler"} - payload.keys():
        raise CheckpointError(f"checkpoint file {path} lacks 'optimizer' and 'scheduler'")
    return payload


def _rank_state(state: dict[str, Any], replicas: GroupReplicas) -> dict[str, Any]:
    """A worker's ``state()`` with its place in the group added."""
    return {**state, "rank": replicas.rank, "data_parallel_size": replicas.world_size}


def _train_without_rows(
    step: StepTracker,
    replicas: GroupReplicas,
    module: torch.nn.Module,
    idle_passes: Callable[..., None],
    step_num_sequences: int,
    step_num_tokens: int | None,
) -> dict[str, float]:
    """A chunk of the step for a rank that holds none of its rows: the step's counts
    declared, and as many zero-gradient passes as the busiest rank runs micro-batches, so
    that every rank issues the same collectives."""
    step.declare(
        step_num_sequences=step_num_sequences,
        step_num_tokens=step_num_tokens,
        num_sequences=0,
    )
    module.train()
    idle_passes(replicas.max_int(0), train=True)
    return StepTracker().summary()


class ShardedPolicyWorker(PolicyWorker):
    """One rank of the sharded policy trainer (see the module docstring)."""

    def __init__(
        self,
        policy_cfg: PolicyConfig,
        loss_cfg: LossConfig,
        *,
        model_path: str | os.PathLike[str] | None = None,
        seed: int = 0,
        torch_num_threads: int | None = None,
    ) -> None:
        # The group is joined before the model is built (rank_group.join_rank_group).
        self.replicas = GroupReplicas(_device_of(policy_cfg.device))
        super().__init__(
            policy_cfg,
            loss_cfg,
            model_path=model_path,
            seed=seed,
            torch_num_threads=torch_num_threads,
        )

    @property
    def is_rank0(self) -> bool:
        return self.replicas.rank == 0

    def _shard_model(self) -> None:
        shard_model(
            self.forward_module,
            _decoder_layers(self.model.base_model, "the policy"),
            self.device,
            reshard_after_forward=_reshard_after_forward(
                self.cfg.dtensor_cfg.reshard_after_forward, self.replicas.world_size
            ),
        )

    def _clip_gradients(self) -> float:
        return sharded_grad_norm_and_clip(
            self.model.parameters(), self.cfg.max_grad_norm, self.replicas
        )

    def state(self) -> dict[str, Any]:
        return _rank_state(super().state(), self.replicas)

    # ------------------------------------------------------------------ rows of this rank

    def _get_logprobs(  # type: ignore[override]
        self, batch: TrainBatch | None, reference: bool = False
    ) -> torch.Tensor | None:
        if batch is not None:
            return super()._get_logprobs(batch, reference)
        if self.cfg.offload_optimizer_for_logprob:
            self._offload.offload()  # as the ranks with rows do (each moves its own shards)
        passes = self.replicas.max_int(0)
        if not reference:  # the frozen reference is one full copy per rank: no collectives
            with torch.no_grad():
                self._idle_passes(passes, train=False)
        return None

    def _train_microbatches(  # type: ignore[override]
        self, batch: TrainBatch | None, step_num_sequences: int, step_num_tokens: int | None
    ) -> dict[str, float]:
        if batch is not None:
            return super()._train_microbatches(batch, step_num_sequences, step_num_tokens)
        return _train_without_rows(
            self._step,
            self.replicas,
            self.model,
            self._idle_passes,
            step_num_sequences,
            step_num_tokens,
        )

    def _offload_optimizer(self) -> None:
        self._offload.offload()

    def _reload_optimizer(self) -> None:
        self._offload.reload()

    # ------------------------------------------------------------------ weights

    def _export_weights_flat(self) -> FlatWeights | None:
        """The full weights on rank 0 (None on the others); every rank must take part."""
        self.forward_module.reshard()  # type: ignore[operator]  # an FSDPModule after sharding
        return gather_flat_weights(self.model.state_dict(), keep=self.is_rank0)

    def _export_weights(self) -> dict[str, torch.Tensor] | None:  # type: ignore[override]
        self.forward_module.reshard()  # type: ignore[operator]
        return gather_full_state_dict(self.model.state_dict(), keep=self.is_rank0)

    async def export_weights_flat(self) -> FlatWeights:  # type: ignore[override]
        return await self._executor.run(self._export_weights_flat)  # type: ignore[arg-type]

    def _load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        load_full_into_sharded(self.model, None, state_dict, None)

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, directory: Path, save_optimizer: bool) -> None:
        directory = Path(directory)
        self.forward_module.reshard()  # type: ignore[operator]
        save_sharded_checkpoint(
            directory,
            self.forward_module,
            self.optimizer if save_optimizer else None,
            self.scheduler,
            rank=self.replicas.rank,
        )
        if self.is_rank0:
            self.model.config.save_pretrained(directory)
            copy_tokenizer_files(self.model_path, directory)
            write_worker_state(
                directory,
                {
                    "kind": "policy",
                    "optimizer_steps": self.optimizer_steps,
                    "has_optimizer": save_optimizer,
                    "layout": SHARDED_LAYOUT,
                    "data_parallel_size": self.replicas.world_size,
                },
            )

    def _load_checkpoint(self, directory: Path, load_optimizer: bool) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"policy checkpoint folder {directory} does not exist")
        state = read_worker_state(directory)
        if state.get("kind") != "policy":
            raise CheckpointError(
                f"{directory} holds a {state.get('kind')!r} checkpoint, not a policy checkpoint"
            )
        optimizer = self.optimizer if load_optimizer else None
        if state.get("layout") == SHARDED_LAYOUT:
            load_sharded_checkpoint(
                directory, self.forward_module, optimizer, self.scheduler, rank=self.replicas.rank
            )
        else:
            # One process's folder: every rank reads the full tensors and keeps its shards.
            payload = _read_optimizer_file(directory) if load_optimizer else None
            model_state = self._read_full_model(directory)
            load_full_into_sharded(
                self.model,
                optimizer,
                model_state,
                None if payload is None else payload["optimizer"],
            )
            if payload is not None:
                self.scheduler.load_state_dict(payload["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])

    def _read_full_model(self, directory: Path) -> dict[str, torch.Tensor]:
        single = directory / "model.safetensors"
        sharded = directory / "model.safetensors.index.json"
        if not single.is_file() and not sharded.is_file():
            raise CheckpointError(
                f"checkpoint file {single} (or {sharded.name}) is missing in {directory}"
            )
        try:
            loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        except Exception as exc:
            raise CheckpointError(f"checkpoint file {single} is corrupt: {exc}") from exc
        return dict(loaded.state_dict())

    def _save_final_model(self, directory: Path) -> str:
        self.forward_module.reshard()  # type: ignore[operator]
        full = gather_full_state_dict(self.model.state_dict(), keep=self.is_rank0)
        if full is None:
            return str(directory)
        with atomic_directory(directory) as tmp:
            self.model.save_pretrained(tmp, state_dict=full, safe_serialization=True)
            copy_tokenizer_files(self.model_path, tmp)
            mask = os.umask(0)
            os.umask(mask)
            for path in tmp.iterdir():  # safetensors writes its file private (0600)
                path.chmod(0o666 & ~mask)
        return str(directory)


class ShardedValueWorker(ValueWorker):
    """One rank of the sharded PPO critic (see the module docstring)."""

    def __init__(
        self,
        value_cfg: ValueConfig,
        loss_cfg: ValueLossConfig,
        *,
        model_path: str | os.PathLike[str] | None = None,
        seed: int = 0,
        device: str = "auto",
        precision: str = "auto",
        activation_checkpointing: bool = False,
        torch_num_threads: int | None = None,
    ) -> None:
        self.replicas = GroupReplicas(_device_of(device))
        super().__init__(
            value_cfg,
            loss_cfg,
            model_path=model_path,
            seed=seed,
            device=device,
            precision=precision,
            activation_checkpointing=activation_checkpointing,
            torch_num_threads=torch_num_threads,
        )

    def _shard_model(self) -> None:
        shard_model(self.critic, _decoder_layers(self.backbone, "the critic"), self.device)

    def _clip_gradients(self) -> float:
        return sharded_grad_norm_and_clip(self._parameters(), self.cfg.max_grad_norm, self.replicas)

    def state(self) -> dict[str, Any]:
        return _rank_state(super().state(), self.replicas)

    def _get_values(self, batch: TrainBatch | None) -> torch.Tensor | None:  # type: ignore[override]
        if batch is not None:
            return super()._get_values(batch)
        passes = self.replicas.max_int(0)
        with torch.no_grad():
            self._idle_passes(passes, train=False)
        return None

    def _train_microbatches(  # type: ignore[override]
        self, batch: TrainBatch | None, step_num_sequences: int, step_num_tokens: int | None
    ) -> dict[str, float]:
        if batch is not None:
            return super()._train_microbatches(batch, step_num_sequences, step_num_tokens)
        return _train_without_rows(
            self._step,
            self.replicas,
            self.backbone,
            self._idle_passes,
            step_num_sequences,
            step_num_tokens,
        )

    def _save_checkpoint(self, directory: Path, save_optimizer: bool) -> None:
        directory = Path(directory)
        self.critic.reshard()  # type: ignore[operator]  # an FSDPModule after sharding
        save_sharded_checkpoint(
            directory,
            self.critic,
            self.optimizer if save_optimizer else None,
            self.scheduler,
            rank=self.replicas.rank,
        )
        if self.replicas.rank == 0:
            write_worker_state(
                directory,
                {
                    "kind": "value",
                    "optimizer_steps": self.optimizer_steps,
                    "has_optimizer": save_optimizer,
                    "layout": SHARDED_LAYOUT,
                    "data_parallel_size": self.replicas.world_size,
                },
            )

    def _load_weights(self, directory: Path, load_optimizer: bool = False) -> dict[str, Any]:
        state = self._read_state(directory)
        if state.get("layout") == SHARDED_LAYOUT:
            return super()._load_weights(directory, load_optimizer)
        payload = _read_optimizer_file(directory) if load_optimizer else None
        backbone_state, head_state = self._read_full_weights(directory)
        full = {
            **{f"backbone.{k}": v for k, v in backbone_state.items()},
            **{f"head.{k}": v for k, v in head_state.items()},
        }
        load_full_into_sharded(
            self.critic,
            self.optimizer if load_optimizer else None,
            full,
            None if payload is None else payload["optimizer"],
        )
        if payload is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        return state


def _device_of(setting: str) -> torch.device:
    from tandemrl.models import resolve_device

    return resolve_device(setting)
