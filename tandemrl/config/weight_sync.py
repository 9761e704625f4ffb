"""Which transport carries the trainer's weights to the generation workers.

``policy.generation.weight_sync`` picks it; ``auto`` decides from where the processes run:

| choice | what travels | needs |
|---|---|---|
| ``object_store`` | a CPU copy of the state dict through Ray's object store | nothing |
| ``cuda_ipc`` | nothing but the version: workers map the trainer's GPU buffer | CUDA; trainer and every worker on one GPU (``colocated.enabled``) |
| ``nccl`` | the flat buffer, broadcast from the trainer (rank 0) | a GPU of its own for every process (not colocated, ≥ 1 generation GPU per worker), or a CPU run (the broadcast then runs over gloo) |

``auto``: ``cuda_ipc`` on CUDA when colocated, ``nccl`` on CUDA when every worker has a GPU of
its own, ``object_store`` otherwise (CPU runs, workers sharing a GPU that is not the
trainer's, a sharded trainer: ``policy.dtensor_cfg.data_parallel_size`` > 1, whose rank 0
gathers the full weights one tensor at a time). The flat-buffer transports (``cuda_ipc``, ``nccl``) exist for the torch engine
only.

The rules are checked twice: by ``tandemrl validate`` from the config alone (``facts_from_config``;
whether CUDA is used may be unknown there), and at launch from the Ray cluster's GPUs, where
``resolve_weight_sync`` also settles ``auto``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandemrl.config.models import MasterConfig

KEY = "policy.generation.weight_sync"


@dataclass(frozen=True)
class SyncFacts:
    """Where the trainer and generation workers run, as far as the weight sync cares."""

    uses_cuda: bool | None  # None: not known from the config alone
    colocated: bool
    gpus_per_worker: float  # generation GPUs ÷ generation workers (non-colocated)
    one_node: bool
    trainer_ranks: int = 1  # policy.dtensor_cfg.data_parallel_size (as settled at launch)


def facts_from_config(
    cfg: MasterConfig, *, cluster_gpus: float | None = None, trainer_ranks: int | None = None
) -> SyncFacts:
    """The facts the config states; ``cluster_gpus`` (the Ray cluster's, at launch) settles
    whether CUDA is used, ``trainer_ranks`` how many ranks the trainer has."""
    generation = cfg.policy.generation
    resources = generation.colocated.resources
    if cfg.policy.device == "cpu":
        uses_cuda: bool | None = False
    elif cluster_gpus is not None:
        uses_cuda = cluster_gpus > 0
    elif cfg.cluster.num_gpus == 0:
        uses_cuda = False
    elif cfg.policy.device == "cuda":
        uses_cuda = True
    else:
        uses_cuda = None
    return SyncFacts(
        uses_cuda=uses_cuda,
        colocated=generation.colocated.enabled,
        gpus_per_worker=resources.gpus_per_node / generation.num_workers,
        one_node=resources.num_nodes == 1,
        trainer_ranks=trainer_ranks or cfg.policy.dtensor_cfg.data_parallel_size or 1,
    )


def weight_sync_problems(cfg: MasterConfig, facts: SyncFacts) -> list[str]:
    """Every reason the configured transport cannot run; each names the keys to change."""
    generation = cfg.policy.generation
    choice = generation.weight_sync
    problems: list[str] = []
    if choice in ("cuda_ipc", "nccl") and generation.backend != "torch":
        problems.append(
            f"{KEY}: {choice!r} needs policy.generation.backend: torch (got "
            f"{generation.backend!r}); use object_store or auto"
        )
    if choice == "cuda_ipc":
        if facts.uses_cuda is False:
            problems.append(
                f"{KEY}: 'cuda_ipc' needs CUDA, but this run has none (policy.device "
                f"{cfg.policy.device!r}, cluster.num_gpus {cfg.cluster.num_gpus}); use nccl (gloo "
                "on CPU) or object_store"
            )
        elif not facts.colocated:
            problems.append(
                f"{KEY}: 'cuda_ipc' needs the trainer and the generation workers on one GPU "
                "(policy.generation.colocated.enabled: true); with generation on GPUs of its "
                "own use nccl"
            )
        elif not facts.one_node:
            problems.append(
                f"{KEY}: 'cuda_ipc' works within one node; policy.generation.colocated."
                f"resources.num_nodes is {generation.colocated.resources.num_nodes}: use nccl"
            )
    if choice == "nccl" and facts.uses_cuda:
        if facts.colocated:
            problems.append(
                f"{KEY}: 'nccl' cannot connect processes that share one GPU "
                "(policy.generation.colocated.enabled: true); use cuda_ipc or auto"
            )
        elif facts.gpus_per_worker < 1:
            problems.append(
                f"{KEY}: 'nccl' needs a GPU of its own for every generation worker, but "
                f"policy.generation.colocated.resources.gpus_per_node="
                f"{generation.colocated.resources.gpus_per_node} is shared by "
                f"policy.generation.num_workers={generation.num_workers}; use object_store, or "
                "one worker per generation GPU"
            )
    if choice in ("cuda_ipc", "nccl") and facts.trainer_ranks > 1:
        problems.append(
            f"{KEY}: {choice!r} sends the weights from one trainer process, but the trainer has "
            f"{facts.trainer_ranks} ranks (policy.dtensor_cfg.data_parallel_size); use "
            "object_store or auto (rank 0 gathers the full weights one tensor at a time into "
            "Ray's object store)"
        )
    if choice == "object_store" and "weight_sync_timeout_s" in generation.model_fields_set:
        problems.append(
            "policy.generation.weight_sync_timeout_s: applies to cuda_ipc and nccl only; drop it "
            f"or set {KEY} to one of them"
        )
    return problems


def resolve_weight_sync(cfg: MasterConfig, facts: SyncFacts) -> str:
    """The transport to use: the configured one, or ``auto`` settled by ``facts``.

    Raises ``ValueError`` listing every problem when the configured transport cannot run.
    """
    problems = weight_sync_problems(cfg, facts)
    if problems:
        raise ValueError("; ".join(problems))
    choice = cfg.policy.generation.weight_sync
    if choice != "auto":
        return choice
    if not facts.uses_cuda or cfg.policy.generation.backend != "torch" or facts.trainer_ranks > 1:
        return "object_store"
    if facts.colocated:
        return "cuda_ipc" if facts.one_node else "object_store"
    return "nccl" if facts.gpus_per_worker >= 1 else "object_store"
