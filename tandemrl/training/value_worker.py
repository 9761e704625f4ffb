"""The PPO critic: a transformers backbone with a scalar value head, trained on the clipped
value loss.

``ValueWorker`` implements ``tandemrl.training.api.ValueTrainer`` with the same split step as
the policy (``begin_train_step`` → ``train_microbatches`` per chunk → ``finish_train_step``,
exactly one optimizer step per finish, token-mean normalized by the whole step's
``step_num_tokens``).

Values are aligned like logprobs: entry t of ``get_values`` is the head applied to the hidden
state at t-1, i.e. the state in which token t is chosen, and estimates the return from token t
on (the quantity ``tandemrl.training.advantages.gae`` expects). Entry 0 and padding are 0.

The backbone is the base model of a causal-LM folder (``AutoModel``: the LM head is dropped);
the head is ``nn.Linear(hidden_size, 1)``, initialised from ``seed``.

Checkpoint folder layout: ``backbone/`` (``save_pretrained``), ``value_head.safetensors``,
``worker_state.json`` and, with ``save_optimizer``, ``optimizer.pt``. ``load_warm_start``
reads the weights (not the optimizer) of such a folder, or of a step folder that holds one
under ``value/``: ``ppo.warm_start_value_checkpoint``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel

from tandemrl.config.models import ValueConfig, ValueLossConfig
from tandemrl.models import resolve_device, resolve_model_path
from tandemrl.training.api import TrainBatch
from tandemrl.training.batch import count_loss_tokens, split_microbatches, trim_padding
from tandemrl.training.losses import value_loss
from tandemrl.training.rank_group import LocalReplicas, Replicas
from tandemrl.training.worker_common import (
    SHARDED_LAYOUT,
    WORKER_STATE_FILE,
    CheckpointError,
    SerialExecutor,
    SplitStepWorkerAPI,
    StepTracker,
    autocast,
    autocast_dtype,
    build_optimizer,
    build_scheduler,
    grad_norm_and_clip,
    load_optimizer_state,
    read_worker_state,
    save_optimizer_state,
    scale_gradients,
    write_worker_state,
)

BACKBONE_DIR = "backbone"
HEAD_FILE = "value_head.safetensors"


class CriticModel(nn.Module):
    """Backbone and value head as one module: one forward call gives [b, l] values (what
    FSDP2's root unit needs to gather the head and the embeddings around it)."""

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Linear,
        *,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.device = device
        self.autocast_dtype = autocast_dtype

    def forward(self, micro: TrainBatch) -> torch.Tensor:
        with autocast(self.device, self.autocast_dtype):
            hidden = self.backbone(
                input_ids=micro["input_ids"],
                attention_mask=micro["attention_mask"],
                use_cache=False,
            ).last_hidden_state
        values = self.head(hidden[:, :-1].float()).squeeze(-1)
        values = F.pad(values, (1, 0))
        return values * micro["attention_mask"].to(values.dtype)


class ValueWorker(SplitStepWorkerAPI):
    """Trains the critic; see the module docstring."""

    # The other ranks of a sharded critic (none here: every reduction is the identity).
    replicas: Replicas = LocalReplicas()

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
        if torch_num_threads is not None:
            torch.set_num_threads(torch_num_threads)
        source = model_path if model_path is not None else value_cfg.model_name
        if source is None:
            raise ValueError(
                "ValueWorker needs a model: set value.model_name or pass model_path "
                "(the policy's folder, as the controller does when value.model_name is null)"
            )
        self.cfg = value_cfg
        self.loss_cfg = loss_cfg
        self.seed = seed
        self.model_path = Path(resolve_model_path(str(source)))
        self.device = resolve_device(device)
        self.autocast_dtype = autocast_dtype(precision, self.device)
        self.backbone = AutoModel.from_pretrained(self.model_path, dtype=torch.float32)
        self.backbone.config.use_cache = False
        if activation_checkpointing:
            self.backbone.gradient_checkpointing_enable()
        hidden_size = self.backbone.config.hidden_size
        self.head = nn.Linear(hidden_size, 1)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.head.weight.normal_(0.0, 1.0 / hidden_size**0.5, generator=generator)
            self.head.bias.zero_()
        self.backbone.to(self.device)
        self.head.to(self.device)
        self.critic = CriticModel(
            self.backbone, self.head, device=self.device, autocast_dtype=self.autocast_dtype
        )
        self._shard_model()
        self.optimizer = build_optimizer(self._parameters(), value_cfg.optimizer, self.device)
        self.scheduler = build_scheduler(self.optimizer, None)
        self._step = StepTracker()
        self._executor = SerialExecutor()
        self.optimizer_steps = 0

    def _shard_model(self) -> None:
        """Nothing to shard in one process (the sharded critic applies FSDP2 here)."""

    def _parameters(self) -> list[nn.Parameter]:
        return list(self.critic.parameters())  # the backbone's, then the head's

    def state(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps, "in_train_step": self._step.active}

    # ------------------------------------------------------------------ forward

    def _forward(self, micro: TrainBatch) -> torch.Tensor:
        return self.critic(micro)

    def _idle_passes(self, count: int, *, train: bool) -> None:
        """``count`` passes over a 2-token dummy row that add exactly 0 to every gradient, so
        that every rank of a sharded critic issues the same collectives (``count`` is 0 in
        one process)."""
        dummy = {
            "input_ids": torch.zeros((1, 2), dtype=torch.long, device=self.device),
            "attention_mask": torch.ones((1, 2), dtype=torch.long, device=self.device),
        }
        for _ in range(max(count, 0)):
            values = self._forward(dummy)
            if train:
                (values.sum() * 0.0).backward()

    def _to_device(self, batch: TrainBatch) -> TrainBatch:
        return {key: value.to(self.device) for key, value in batch.items()}

    def _get_values(self, batch: TrainBatch) -> torch.Tensor:
        self.backbone.eval()
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        start = 0
        micros = split_microbatches(batch, self.cfg.train_micro_batch_size)
        passes = self.replicas.max_int(len(micros))  # before any pass: collectives line up
        with torch.no_grad():
            for micro in micros:
                size = micro["input_ids"].shape[0]
                values = self._forward(self._to_device(trim_padding(micro)))
                out[start : start + size, : values.shape[1]] = values.cpu()
                start += size
            self._idle_passes(passes - len(micros), train=False)
        return out

    # ------------------------------------------------------------------ split train step

    def _train_microbatches(
        self, batch: TrainBatch, step_num_sequences: int, step_num_tokens: int | None
    ) -> dict[str, float]:
        normalizer = self._step.declare(
            step_num_sequences=step_num_sequences,
            step_num_tokens=step_num_tokens,
            num_sequences=int(batch["input_ids"].shape[0]),
        )
        self.backbone.train()
        chunk = StepTracker()
        micros = [
            micro
            for micro in split_microbatches(batch, self.cfg.train_micro_batch_size)
            if count_loss_tokens(micro) > 0  # the others add exactly 0 to loss and gradient
        ]
        passes = self.replicas.max_int(len(micros))  # before any pass: collectives line up
        for micro in micros:
            micro = self._to_device(trim_padding(micro))
            loss, metrics = value_loss(
                self._forward(micro), micro, self.loss_cfg, num_step_tokens=normalizer
            )
            loss.backward()
            chunk.add(metrics)
            self._step.add(metrics)
        self._idle_passes(passes - len(micros), train=True)
        # Report the chunk's own token-mean loss (its share of the step is not final while
        # the step's token count is still unknown).
        return chunk.summary(normalizer / chunk.valid_tokens if chunk.valid_tokens else 1.0)

    def _finish_train_step(self) -> dict[str, float]:
        try:
            # Over every rank: the step's tokens (rows, for a sequence mean) normalise the loss
            # wherever they were trained.
            valid_tokens = self.replicas.sum_int(self._step.valid_tokens)
            sequences = self.replicas.sum_int(self._step.sequences)
            self._step.check_finish(valid_tokens, sequences)
            lr = float(self.scheduler.get_last_lr()[0])
            scale = self._step.gradient_scale(token_level=True, valid_tokens=valid_tokens)
            scale_gradients(self._parameters(), scale)
            grad_norm = self._clip_gradients()
            self.optimizer.step()
            self.scheduler.step()
        except Exception:
            self.optimizer.zero_grad(set_to_none=True)
            self._step.end()
            raise
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        metrics = self._step.summary(scale)
        self._step.end()
        metrics.update(
            {"grad_norm": grad_norm, "lr": lr, "optimizer_steps": float(self.optimizer_steps)}
        )
        return metrics

    def _clip_gradients(self) -> float:
        return grad_norm_and_clip(self._parameters(), self.cfg.max_grad_norm)

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, directory: Path, save_optimizer: bool) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(directory / BACKBONE_DIR, safe_serialization=True)
        head_state = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        save_file(head_state, str(directory / HEAD_FILE))
        if save_optimizer:
            save_optimizer_state(directory, self.optimizer, self.scheduler)
        write_worker_state(
            directory,
            {
                "kind": "value",
                "optimizer_steps": self.optimizer_steps,
                "has_optimizer": save_optimizer,
            },
        )

    def _read_state(self, directory: Path) -> dict[str, Any]:
        if not directory.is_dir():
            raise CheckpointError(f"value checkpoint folder {directory} does not exist")
        state = read_worker_state(directory)
        if state.get("kind") != "value":
            raise CheckpointError(
                f"{directory} holds a {state.get('kind')!r} checkpoint, not a value checkpoint"
            )
        return state

    def _load_weights(self, directory: Path, load_optimizer: bool = False) -> dict[str, Any]:
        """The folder's weights (and with ``load_optimizer`` its optimizer state), in either
        layout: one process's files, or a sharded critic's DCP folder."""
        state = self._read_state(directory)
        if state.get("layout") == SHARDED_LAYOUT:
            from tandemrl.training.fsdp import load_sharded_checkpoint

            load_sharded_checkpoint(
                directory,
                self.critic,
                self.optimizer if load_optimizer else None,
                self.scheduler,
                rank=self.replicas.rank,
            )
            return state
        backbone_state, head_state = self._read_full_weights(directory)
        try:
            self.backbone.load_state_dict(backbone_state, strict=True)
            self.head.load_state_dict(head_state, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(
                f"value checkpoint {directory} does not match this model: {exc}"
            ) from exc
        if load_optimizer:
            load_optimizer_state(directory, self.optimizer, self.scheduler)
        return state

    def _read_full_weights(
        self, directory: Path
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(backbone, head) state dicts of one process's folder, read on the host."""
        backbone_dir = directory / BACKBONE_DIR
        weights = backbone_dir / "model.safetensors"
        if not weights.is_file() and not (backbone_dir / "model.safetensors.index.json").is_file():
            raise CheckpointError(f"checkpoint file {weights} is missing")
        head_file = directory / HEAD_FILE
        if not head_file.is_file():
            raise CheckpointError(f"checkpoint file {head_file} is missing")
        try:
            loaded = AutoModel.from_pretrained(backbone_dir, dtype=torch.float32)
            backbone_state = loaded.state_dict()
        except Exception as exc:
            raise CheckpointError(f"checkpoint file {weights} is corrupt: {exc}") from exc
        try:
            head_state = load_file(str(head_file))
        except Exception as exc:
            raise CheckpointError(f"checkpoint file {head_file} is corrupt: {exc}") from exc
        return backbone_state, head_state

    def _load_checkpoint(self, directory: Path, load_optimizer: bool) -> None:
        state = self._load_weights(Path(directory), load_optimizer)
        self.optimizer_steps = int(state["optimizer_steps"])

    def _load_warm_start(self, checkpoint_dir: Path) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        nested = checkpoint_dir / "value"
        if not (checkpoint_dir / WORKER_STATE_FILE).is_file() and nested.is_dir():
            checkpoint_dir = nested
        self._load_weights(checkpoint_dir)

    # ------------------------------------------------------------------ the ValueTrainer contract

    async def get_values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] value estimates on CPU (no grad); 0 at position 0 and on padding."""
        return await self._executor.run(self._get_values, batch)

    async def load_warm_start(self, checkpoint_dir: Path) -> None:
        """Seed the critic's weights (not its optimizer) from a value checkpoint folder."""
        await self._executor.run(self._load_warm_start, Path(checkpoint_dir))


def create_value_worker_actor(
    value_cfg: ValueConfig,
    loss_cfg: ValueLossConfig,
    *,
    model_path: str | os.PathLike[str] | None = None,
    seed: int = 0,
    device: str = "auto",
    precision: str = "auto",
    activation_checkpointing: bool = False,
    num_cpus: float = 1,
    num_gpus: float = 0,
    torch_num_threads: int | None = 1,
    **actor_options: Any,
) -> Any:
    """Start a ``ValueWorker`` as a Ray actor; ``actor_options`` go to ``.options()``."""
    import ray

    actor_class = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(ValueWorker)
    if actor_options:
        actor_class = actor_class.options(**actor_options)
    return actor_class.remote(
        value_cfg,
        loss_cfg,
        model_path=None if model_path is None else str(model_path),
        seed=seed,
        device=device,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        torch_num_threads=torch_num_threads,
    )
