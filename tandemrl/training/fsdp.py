"""FSDP2 for the trainer ranks: sharding a model, the global gradient norm, gathering full
tensors one at a time, and sharded checkpoints with ``torch.distributed.checkpoint``.

Sharding (``shard_model``): ``fully_shard`` on every decoder layer, then on the root module
(what the worker's one forward call goes through; it owns the embeddings, the final norm and
the tied LM head). On CUDA the parameters are all-gathered in bfloat16 and gradients are
reduced in float32 (``MixedPrecisionPolicy``); the sharded master copy and the optimizer state
stay float32. On CPU everything is float32. Gradients are reduced with a plain SUM and no
division (``set_gradient_divide_factor(1)`` with sum-only collectives): every rank's loss is
already its share of the step's loss — token sums divided by the step's global token count —
so the sum over ranks is the step's gradient. (Averaging would need the world size divided back
out, and ``AVG`` / pre-multiplied sums over gloo are where gradients go silently wrong:
pytorch #162338.)

Gathering (``gather_flat_weights``, ``gather_full_state_dict``): every rank walks the state
dict in the same order and all-gathers one parameter at a time (``full_tensor``); rank 0 copies
it into its host buffer and drops it before the next, so no rank ever holds a second full copy
of the model on its device. Tied parameters are gathered once.

Checkpoints (``save_sharded`` / ``load_sharded``): the model and optimizer state dicts keyed
by parameter names (``torch.distributed.checkpoint.state_dict``), written by every rank into one
DCP folder: a ``.metadata`` file and one ``__<rank>_0.distcp`` file per rank. DCP reshards on
load, so a folder written by N ranks loads at any other number of ranks, or into one unsharded
process. Before anything is read, ``check_dcp_files`` checks that every file the metadata
names exists: a checkpoint missing a shard is refused with the file named, never partly loaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tandemrl.training.rank_group import Replicas
from tandemrl.training.shard_adamw import local_part
from tandemrl.training.worker_common import CheckpointError
from tandemrl.transport.object_store import FlatWeights

DCP_DIR = "dcp"
DCP_METADATA = ".metadata"


def shard_model(
    root: nn.Module,
    layers: Iterable[nn.Module],
    device: torch.device,
    *,
    reshard_after_forward: bool = True,
) -> None:
    """``fully_shard`` each of ``layers``, then ``root``, over every rank of the default group
    (``reshard_after_forward``: ``policy.dtensor_cfg.reshard_after_forward``)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    layers = list(layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    units = [*layers, root]
    for unit in units:
        assert isinstance(unit, FSDPModule)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def sharded_grad_norm_and_clip(
    params: Iterable[nn.Parameter], max_grad_norm: float | None, replicas: Replicas
) -> float:
    """The gradient norm over every rank's shards (one all-reduce); clips to
    ``max_grad_norm`` like ``torch.nn.utils.clip_grad_norm_`` (coefficient max / (norm + 1e-6),
    applied when below 1). A non-finite norm raises on every rank alike."""
    with torch.no_grad():  # to_local() outside autograd: a fifth of the cost, 290 times a step
        grads = [local_part(p.grad) for p in params if p.grad is not None]
        # This rank's squared norm in one device reduction, summed over the ranks on the
        # device, then one host read a step (not one per parameter, nor one per rank).
        if grads:
            squared = torch.nn.utils.get_total_norm(grads).double().square().reshape(1)
        else:
            squared = torch.zeros(1, dtype=torch.float64, device=replicas.device)
        norm = math.sqrt(float(replicas.sum_tensor_(squared).item()))
        if not math.isfinite(norm):
            raise FloatingPointError(
                f"gradient norm is {norm}; refusing the optimizer step (lower the lr, check the "
                "advantages and logprobs for inf/NaN)"
            )
        if max_grad_norm is not None:
            coefficient = max_grad_norm / (norm + 1e-6)
            if coefficient < 1.0 and grads:
                torch._foreach_mul_(grads, coefficient)
    return norm


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gather_flat_weights(
    state_dict: Mapping[str, torch.Tensor], *, keep: bool
) -> FlatWeights | None:
    """The full model as ``FlatWeights`` (float32, tied parameters once) on the rank with
    ``keep``; None on the others. Every rank must call it (it all-gathers)."""
    entries: list[tuple[str, tuple[int, ...], int]] = []
    offsets: dict[int, int] = {}
    unique: list[tuple[int, torch.Tensor]] = []
    extras: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state_dict.items():
        if not tensor.is_floating_point():
            full = _full(tensor)
            if keep:
                extras.append((name, full.detach().to("cpu", copy=True)))
            continue
        key = id(tensor)
        if key not in offsets:
            offsets[key] = size
            unique.append((size, tensor))
            size += tensor.numel()
        entries.append((name, tuple(tensor.shape), offsets[key]))
    buffer = np.empty(size, dtype=np.float32) if keep else None
    flat = torch.from_numpy(buffer) if buffer is not None else None
    with torch.no_grad():
        for offset, tensor in unique:
            full = _full(tensor.detach())
            if flat is not None:
                flat[offset : offset + full.numel()].copy_(full.reshape(-1))
            del full
    if buffer is None:
        return None
    return FlatWeights(buffer=buffer, entries=tuple(entries), extras=tuple(extras))


def gather_full_state_dict(
    state_dict: Mapping[str, torch.Tensor], *, keep: bool
) -> dict[str, torch.Tensor] | None:
    """Full CPU copies of every entry on the rank with ``keep`` (tied names share one copy);
    None on the others. Every rank must call it."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in state_dict.items():
            if id(tensor) in seen:
                if keep:
                    out[name] = seen[id(tensor)]
                continue
            full = _full(tensor.detach())
            if keep:
                copy = full.to("cpu", copy=True).contiguous()
                seen[id(tensor)] = out[name] = copy
            del full
    return out if keep else None


# ---------------------------------------------------------------------------- checkpoints


def check_dcp_files(folder: Path) -> None:
    """Raise ``CheckpointError`` naming the first file of a DCP folder that is missing."""
    metadata_file = folder / DCP_METADATA
    if not metadata_file.is_file():
        raise CheckpointError(f"checkpoint file {metadata_file} is missing")
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {metadata_file} is unreadable: {exc}") from exc
    names = sorted({item.relative_path for item in (metadata.storage_data or {}).values()})
    for name in names:
        if not (folder / name).is_file():
            raise CheckpointError(
                f"checkpoint file {folder / name} is missing (a shard of {folder}; its "
                f"{DCP_METADATA} lists {len(names)} shard file(s)): refusing to load any of it"
            )


def dcp_shard_files(folder: Path) -> list[str]:
    """The shard files a DCP folder's metadata lists (for ``tandemrl inspect``)."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    return sorted({item.relative_path for item in (metadata.storage_data or {}).values()})


def training_state(root: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Model (and optimizer) state keyed by parameter names, sharded as the module is."""
    state: dict[str, Any] = {"model": get_model_state_dict(root)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(root, optimizer)
    return state


def save_sharded(folder: Path, root: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank writes its shards of the model (and optimizer) into ``folder``."""
    dcp.save(training_state(root, optimizer), checkpoint_id=str(folder))


def load_sharded(folder: Path, root: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a DCP folder written at any number of ranks into ``root`` (and ``optimizer``);
    refuses a folder with a missing file before reading anything."""
    check_dcp_files(folder)
    state = training_state(root, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except Exception as exc:
        raise CheckpointError(
            f"sharded checkpoint {folder} does not match this model"
            + (" and optimizer" if optimizer is not None else "")
            + f": {exc}"
        ) from exc
    set_model_state_dict(root, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(root, optimizer, state["optimizer"])


def load_full_into_sharded(
    root: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
) -> None:
    """An unsharded checkpoint (full tensors on every rank) into a sharded module.

    ``optimizer_state`` is torch's own ``optimizer.state_dict()`` of the unsharded worker,
    keyed by parameter position; positions are mapped to names through ``root``'s
    ``named_parameters`` (the order the optimizer was built in on both sides).
    """
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(root, model_state, options=options)
    if optimizer is None or optimizer_state is None:
        return
    names = [name for name, _ in root.named_parameters()]
    by_position = dict(enumerate(names))
    named = {
        "state": {by_position[int(k)]: v for k, v in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [by_position[int(i)] for i in group["params"]]}
            for group in optimizer_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(root, optimizer, named, options=options)


# ---------------------------------------------------------------------------- worker folders

SCHEDULER_FILE = "scheduler.pt"
RNG_DIR = "rng"


def rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank_{rank}.pt"


def save_sharded_checkpoint(
    directory: Path,
    root: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    rank: int,
) -> None:
    """Every rank: its model and optimizer shards (``dcp/``) and its RNG state
    (``rng/rank_<r>.pt``); rank 0 also the scheduler (``scheduler.pt``) with the optimizer."""
    (directory / RNG_DIR).mkdir(parents=True, exist_ok=True)
    save_sharded(directory / DCP_DIR, root, optimizer)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, rng_file(directory, rank))
    if rank == 0 and optimizer is not None:
        torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)


def load_sharded_checkpoint(
    directory: Path,
    root: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    rank: int,
) -> None:
    """Load a folder ``save_sharded_checkpoint`` wrote at any number of ranks.

    Every file is checked before anything is read. The RNG state of ``rank`` is restored when
    the folder has one (a folder written by fewer ranks has none for the extra ranks: they
    keep the state seeded at start-up).
    """
    check_dcp_files(directory / DCP_DIR)
    scheduler_file = directory / SCHEDULER_FILE
    if optimizer is not None and not scheduler_file.is_file():
        raise CheckpointError(
            f"checkpoint file {scheduler_file} is missing: the checkpoint was saved without "
            "optimizer state (checkpointing.save_optimizer: false); load it with "
            "load_optimizer=False"
        )
    load_sharded(directory / DCP_DIR, root, optimizer)
    if scheduler is not None and optimizer is not None:
        try:
            scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        except Exception as exc:
            raise CheckpointError(f"checkpoint file {scheduler_file} is corrupt: {exc}") from exc
    rng_path = rng_file(directory, rank)
    if rng_path.is_file():
        rng = torch.load(rng_path, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def describe_sharded_folder(directory: Path) -> dict[str, Any]:
    """What ``tandemrl inspect`` shows of a sharded worker folder: its DCP shard files and
    which ranks' RNG states it holds."""
    folder = directory / DCP_DIR
    info: dict[str, Any] = {"dcp_dir": str(folder), "shard_files": [], "rng_ranks": []}
    try:
        info["shard_files"] = dcp_shard_files(folder)
    except Exception as exc:  # shown, not raised: inspect reports what it finds
        info["error"] = f"unreadable {folder / DCP_METADATA}: {exc}"
    rng_dir = directory / RNG_DIR
    if rng_dir.is_dir():
        info["rng_ranks"] = sorted(
            int(path.stem.split("_")[1]) for path in rng_dir.glob("rank_*.pt")
        )
    info["missing"] = [name for name in info["shard_files"] if not (folder / name).is_file()]
    return info
