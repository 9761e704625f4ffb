"""The trainer group's pure parts: row split, metric merge, call order on a rank, the error
that names a failed rank, placement of the ranks, and what validation refuses."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import load_config
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.config.weight_sync import facts_from_config, resolve_weight_sync
from tandemrl.controller.setup import PlacementError, plan_placement
from tandemrl.training.trainer_group import (
    ShardedTrainer,
    TrainerRankActor,
    merge_metrics,
    split_rows_by_tokens,
)
from tandemrl.training.worker_common import TrainStepError

CPU_JOB = "examples/configs/grpo_tiny_cpu.yaml"
GPU = ("policy.device=cuda", "policy.generation.colocated.resources.gpus_per_node=1")


def test_rows_go_to_the_rank_with_the_fewest_tokens() -> None:
    tokens = [50, 10, 40, 30, 20, 5]
    shares = split_rows_by_tokens(tokens, 2)
    assert shares == [[0, 1, 4], [2, 3, 5]]  # 80 and 75 tokens; each share in batch order
    assert split_rows_by_tokens([7], 3) == [[0], [], []]  # a rank may get no row


def test_metrics_merge_by_kind() -> None:
    ranks = [
        {"loss": 0.2, "num_tokens": 30.0, "entropy": 1.0, "is_weight_max": 1.5, "grad_norm": 2.0},
        {"loss": 0.4, "num_tokens": 10.0, "entropy": 2.0, "is_weight_max": 1.2, "grad_norm": 2.0},
        {"num_chunks": 0.0},  # a rank without rows
    ]
    step = merge_metrics(ranks, mean_loss=False)
    assert step["loss"] == pytest.approx(0.6)  # each rank's share of the step's loss
    assert step["entropy"] == pytest.approx(1.25)  # token-weighted
    assert (step["num_tokens"], step["is_weight_max"], step["grad_norm"]) == (40.0, 1.5, 2.0)
    chunk = merge_metrics(ranks, mean_loss=True)
    assert chunk["loss"] == pytest.approx(0.25)  # token means of each rank's rows


def test_a_rank_runs_one_callers_calls_in_sequence_order() -> None:
    order: list[str] = []
    gate = threading.Event()

    class Worker:
        def first(self) -> str:
            gate.wait(5)
            order.append("first")
            return "first"

        def second(self) -> str:
            order.append("second")
            return "second"

    async def drive() -> list[str]:
        rank = TrainerRankActor("policy", 0, 1, 10.0)
        rank.worker = Worker()
        later = asyncio.ensure_future(rank.call("driver", 1, "second"))  # arrives first
        await asyncio.sleep(0.05)
        earlier = asyncio.ensure_future(rank.call("driver", 0, "first"))
        await asyncio.sleep(0.05)
        gate.set()
        return list(await asyncio.gather(earlier, later))

    assert asyncio.run(drive()) == ["first", "second"]
    assert order == ["first", "second"]


def test_the_error_names_the_rank_that_died_before_one_that_merely_failed() -> None:
    from ray.exceptions import ActorDiedError

    trainer = ShardedTrainer([object(), object()], role="policy trainer")
    error = trainer._rank_error(
        "train_microbatches",
        {0: RuntimeError("Connection closed by peer"), 1: ActorDiedError()},
    )
    message = str(error)
    assert message.startswith(
        "policy trainer rank 1 of 2 died (its process exited) during train_microbatches"
    )
    assert "rank(s) [0] failed after it" in message


def test_placement_of_trainer_ranks() -> None:
    cpu = plan_placement(
        load_config(CPU_JOB, ("policy.dtensor_cfg.data_parallel_size=3",)),
        cluster_cpus=2,
        cluster_gpus=0,
    )
    assert (cpu.trainer_ranks, cpu.trainer_cpus) == (3, 0.5)  # 4 processes on 2 CPUs
    assert plan_placement(load_config(CPU_JOB), cluster_cpus=8, cluster_gpus=4).trainer_ranks == 1
    # a GPU run takes every GPU generation leaves, one per rank
    gpu = plan_placement(load_config(CPU_JOB, GPU), cluster_cpus=32, cluster_gpus=4)
    assert (gpu.trainer_ranks, gpu.trainer_gpus, gpu.generation_gpus) == (3, 1.0, 1.0)
    with pytest.raises(PlacementError, match="data_parallel_size=4 trainer ranks need a GPU each"):
        plan_placement(
            load_config(CPU_JOB, (*GPU, "policy.dtensor_cfg.data_parallel_size=4")),
            cluster_cpus=32,
            cluster_gpus=4,
        )
    colocated = load_config(
        CPU_JOB, ("policy.device=cuda", "policy.generation.colocated.enabled=true")
    )
    assert plan_placement(colocated, cluster_cpus=8, cluster_gpus=2).trainer_ranks == 1


def test_a_sharded_gpu_trainer_sends_weights_through_the_object_store() -> None:
    cfg = load_config(CPU_JOB, GPU)
    assert (
        resolve_weight_sync(cfg, facts_from_config(cfg, cluster_gpus=3, trainer_ranks=1)) == "nccl"
    )
    assert (
        resolve_weight_sync(cfg, facts_from_config(cfg, cluster_gpus=3, trainer_ranks=2))
        == "object_store"
    )


def test_validation_refuses_what_a_sharded_trainer_cannot_do() -> None:
    cfg = load_config(
        CPU_JOB,
        (
            "policy.dtensor_cfg.data_parallel_size=2",
            "policy.compile_layers=true",
            "policy.generation.weight_sync=nccl",
            "cluster.actor_resources.trainer.GPU=1",
            "data_plane.actor_resources.storage=1",
        ),
    )
    with pytest.raises(ConfigError) as refused:
        validate_single_controller_config(cfg)
    message = str(refused.value)
    assert (
        "policy.compile_layers: true is not supported with policy.dtensor_cfg.data_parallel_size=2"
        in message
    )
    assert (
        "policy.generation.weight_sync: 'nccl' sends the weights from one trainer process"
        in message
    )
    assert (
        "cluster.actor_resources.trainer.GPU: CPUs, GPUs and memory come from the placement"
        in message
    )
    assert "data_plane.actor_resources: applies to backend simple only" in message
    colocated = load_config(
        CPU_JOB,
        ("policy.dtensor_cfg.data_parallel_size=2", "policy.generation.colocated.enabled=true"),
    )
    with pytest.raises(ConfigError, match=r"colocated\.enabled: true is not supported"):
        validate_single_controller_config(colocated)
    vision = load_config(
        "examples/configs/grpo_tiny_cpu_vlm.yaml", ("policy.dtensor_cfg.data_parallel_size=2",)
    )
    with pytest.raises(ConfigError, match=r"policy\.is_vlm: true is not supported with"):
        validate_single_controller_config(vision)
    ok = load_config(
        CPU_JOB,
        ("policy.dtensor_cfg.data_parallel_size=2", "cluster.actor_resources.trainer.slot=1"),
    )
    validate_single_controller_config(ok)


class RecordingRank:
    """A rank actor stand-in: records the methods fanned out to it and answers at once."""

    def __init__(self) -> None:
        self.methods: list[str] = []
        self.call = self  # ``rank.call.remote(...)``, as on a Ray actor handle

    def remote(self, caller: str, seq: int, method: str, *args: object) -> asyncio.Future:
        self.methods.append(method)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result({"num_tokens": 1.0} if method == "_finish_train_step" else None)
        return answer


def test_split_step_calls_out_of_order_are_refused_before_any_rank_sees_them() -> None:
    """As one process refuses them (the controller never calls finish without a begin)."""
    ranks = [RecordingRank(), RecordingRank()]
    trainer = ShardedTrainer(ranks, role="policy trainer")

    async def drive() -> dict[str, float]:
        with pytest.raises(TrainStepError, match="finish_train_step called outside a train step"):
            await trainer.finish_train_step()
        with pytest.raises(TrainStepError, match="train_microbatches called outside a train"):
            await trainer.train_microbatches({}, step_num_sequences=4)
        await trainer.begin_train_step()
        with pytest.raises(TrainStepError, match="while a step is open"):
            await trainer.begin_train_step()
        metrics = await trainer.finish_train_step()
        with pytest.raises(TrainStepError, match="finish_train_step called outside a train step"):
            await trainer.finish_train_step()
        return metrics

    assert asyncio.run(drive())["num_tokens"] == 2.0
    assert [rank.methods for rank in ranks] == [["_begin_train_step", "_finish_train_step"]] * 2
