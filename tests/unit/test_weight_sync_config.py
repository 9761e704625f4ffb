"""``policy.generation.weight_sync``: the rules, ``auto``, and GPU placement for any GPU count."""

from __future__ import annotations

import pytest

from tandemrl.config import ConfigError, validate_single_controller_config
from tandemrl.config.loader import load_config
from tandemrl.config.weight_sync import KEY, facts_from_config, resolve_weight_sync
from tandemrl.controller.actor import make_weight_sync
from tandemrl.controller.setup import PlacementError, plan_placement
from tandemrl.controller.weight_sync import (
    CudaIpcWeightSync,
    NcclWeightSync,
    RayObjectStoreWeightSync,
)
from tandemrl.rollout.generation_pool import GenerationPool

GPU_RUN = ("policy.device=cuda",)
COLOCATED = (
    "policy.generation.colocated.enabled=true",
    "async_rl.min_groups_for_streaming_train=16",
)


def cfg(*overrides: str):
    """The default job with ``policy.device: auto`` (the exemplar pins cpu)."""
    return load_config("examples/configs/grpo_tiny_cpu.yaml", ("policy.device=auto", *overrides))


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate_single_controller_config(cfg(*overrides))
    return [message for message in caught.value.messages if KEY in message]


def resolved(*overrides: str, cluster_gpus: float) -> str:
    config = cfg(*overrides)
    return resolve_weight_sync(config, facts_from_config(config, cluster_gpus=cluster_gpus))


def test_auto_picks_by_where_the_processes_run() -> None:
    assert resolved(cluster_gpus=0) == "object_store"
    assert resolved("policy.device=cpu", cluster_gpus=2) == "object_store"
    assert resolved(*COLOCATED, cluster_gpus=1) == "cuda_ipc"
    gpus_1 = "policy.generation.colocated.resources.gpus_per_node=1"
    assert resolved(gpus_1, cluster_gpus=2) == "nccl"
    two_workers = ("policy.generation.colocated.resources.gpus_per_node=2",)
    assert resolved(*two_workers, "policy.generation.num_workers=2", cluster_gpus=3) == "nccl"
    # two workers sharing one generation GPU: NCCL cannot join them, IPC cannot reach them
    assert resolved(gpus_1, "policy.generation.num_workers=2", cluster_gpus=2) == "object_store"


def test_explicit_choices_pass_through_where_they_can_run() -> None:
    assert resolved(f"{KEY}=nccl", cluster_gpus=0) == "nccl"  # gloo on CPU
    assert resolved(f"{KEY}=object_store", *COLOCATED, cluster_gpus=1) == "object_store"
    assert resolved(f"{KEY}=cuda_ipc", *COLOCATED, cluster_gpus=1) == "cuda_ipc"
    validate_single_controller_config(cfg(f"{KEY}=nccl"))  # a CPU run: valid


def test_cuda_ipc_without_cuda_is_refused_naming_the_key() -> None:
    (message,) = problems(f"{KEY}=cuda_ipc", "policy.device=cpu", *COLOCATED)
    assert "needs CUDA" in message and "use nccl" in message
    (message,) = problems(f"{KEY}=cuda_ipc", "cluster.num_gpus=0", *COLOCATED)
    assert "needs CUDA" in message
    config = cfg(f"{KEY}=cuda_ipc", *COLOCATED)  # device auto: settled by the cluster
    with pytest.raises(ValueError, match="'cuda_ipc' needs CUDA"):
        resolve_weight_sync(config, facts_from_config(config, cluster_gpus=0))


def test_cuda_ipc_needs_one_gpu_and_nccl_a_gpu_per_process() -> None:
    (message,) = problems(f"{KEY}=cuda_ipc", *GPU_RUN)
    assert "colocated.enabled: true" in message
    (message,) = problems(f"{KEY}=nccl", *GPU_RUN, *COLOCATED)
    assert "share one GPU" in message
    (message,) = problems(
        f"{KEY}=nccl",
        *GPU_RUN,
        "policy.generation.num_workers=2",
        "policy.generation.colocated.resources.gpus_per_node=1",
    )
    assert "a GPU of its own" in message and "num_workers=2" in message


def test_flat_buffer_transports_need_the_torch_backend_and_timeouts_need_them() -> None:
    (message,) = problems(
        f"{KEY}=nccl",
        "policy.generation.backend=vllm",
        "policy.generation.vllm_cfg.async_engine=true",
    )
    assert "backend: torch" in message
    (message,) = problems(f"{KEY}=object_store", "policy.generation.weight_sync_timeout_s=5")
    assert message.startswith("policy.generation.weight_sync_timeout_s")


def test_make_weight_sync_builds_each_transport() -> None:
    pool = GenerationPool([object()])
    assert isinstance(
        make_weight_sync("object_store", None, pool, timeout_s=1), RayObjectStoreWeightSync
    )
    assert isinstance(make_weight_sync("cuda_ipc", None, pool, timeout_s=1), CudaIpcWeightSync)
    nccl = make_weight_sync("nccl", None, pool, timeout_s=7)
    assert isinstance(nccl, NcclWeightSync) and nccl.timeout_s == 7
    with pytest.raises(ValueError, match="auto is settled at launch"):
        make_weight_sync("auto", None, pool, timeout_s=1)


@pytest.mark.parametrize(
    ("cluster_gpus", "generation_gpus", "workers", "per_worker"),
    [(2, 1, 1, 1.0), (4, 2, 2, 1.0), (8, 7, 7, 1.0), (3, 1, 2, 0.5)],
)
def test_non_colocated_placement_for_any_gpu_count(
    cluster_gpus: int, generation_gpus: int, workers: int, per_worker: float
) -> None:
    placement = plan_placement(
        cfg(
            f"policy.generation.colocated.resources.gpus_per_node={generation_gpus}",
            f"policy.generation.num_workers={workers}",
        ),
        cluster_cpus=32,
        cluster_gpus=cluster_gpus,
    )
    assert placement.generation_gpus == per_worker
    assert placement.trainer_gpus == 1.0


def test_placement_refuses_more_gpus_than_workers_and_no_gpu_left_to_train() -> None:
    with pytest.raises(PlacementError, match="set num_workers to 2"):
        plan_placement(
            cfg("policy.generation.colocated.resources.gpus_per_node=2"),
            cluster_cpus=8,
            cluster_gpus=4,
        )
    with pytest.raises(PlacementError, match="give generation 1 to 1 of them"):
        plan_placement(
            cfg("policy.generation.colocated.resources.gpus_per_node=2"),
            cluster_cpus=8,
            cluster_gpus=2,
        )
    colocated = plan_placement(cfg(*COLOCATED), cluster_cpus=8, cluster_gpus=1)
    assert (colocated.generation_gpus, colocated.trainer_gpus) == (0.5, 0.5)


@pytest.mark.parametrize("cluster_gpus", [0, 1, 2, 8])
def test_a_cpu_run_takes_no_gpu_however_many_the_cluster_has(cluster_gpus: int) -> None:
    """The README's main job (policy.device: cpu) on machines with 0, 1 and several GPUs."""
    main_job = load_config("examples/configs/grpo_tiny_cpu.yaml")
    placement = plan_placement(main_job, cluster_cpus=16, cluster_gpus=cluster_gpus)
    assert (placement.generation_gpus, placement.trainer_gpus) == (0.0, 0.0)
    assert (placement.generation_cpus, placement.trainer_cpus) == (1.0, 1.0)
    facts = facts_from_config(main_job, cluster_gpus=cluster_gpus)
    assert resolve_weight_sync(main_job, facts) == "object_store"


@pytest.mark.parametrize("cluster_gpus", [0, 1, 2, 8])
def test_auto_device_follows_the_cluster(cluster_gpus: int) -> None:
    colocated = plan_placement(cfg(*COLOCATED), cluster_cpus=16, cluster_gpus=cluster_gpus)
    expected = (0.0, 0.0) if cluster_gpus == 0 else (0.5, 0.5)
    assert (colocated.generation_gpus, colocated.trainer_gpus) == expected


def test_a_gpu_run_that_cannot_be_placed_says_which_key_to_change() -> None:
    with pytest.raises(PlacementError) as one_gpu:
        plan_placement(cfg(), cluster_cpus=16, cluster_gpus=1)
    message = str(one_gpu.value)
    assert "needs at least 2 GPUs" in message
    assert "policy.generation.colocated.enabled: true" in message
    assert "policy.device: cpu" in message
    with pytest.raises(PlacementError) as no_gpu:
        plan_placement(cfg(*GPU_RUN), cluster_cpus=16, cluster_gpus=0)
    assert "policy.device: cuda, but the Ray cluster has no GPU" in str(no_gpu.value)
    with pytest.raises(PlacementError, match="this is a CPU run"):
        plan_placement(
            cfg("policy.device=cpu", "policy.generation.colocated.resources.gpus_per_node=1"),
            cluster_cpus=16,
            cluster_gpus=2,
        )
