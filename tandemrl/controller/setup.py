"""Launch a run's processes on Ray: generation workers, the policy trainer, the controller.

Placement comes from the config, never from the machine alone: ``policy.device`` says whether
the run uses GPUs (``cpu``: none, however many the cluster has; ``cuda``: it needs them;
``auto``: GPUs when the cluster has any), and the blocks below say how many each process takes.

- CPU run (``policy.device: cpu``, or ``auto`` on a cluster without GPUs): each generation
  worker and the policy trainer reserve one CPU (half a CPU each when the cluster has fewer
  CPUs than processes) and no GPU, so generation and training run on different cores and
  overlap in time.
- GPU, non-colocated: ``policy.generation.colocated.resources.gpus_per_node`` (k) GPUs go to
  generation, split over ``policy.generation.num_workers`` (one GPU each, or a share of one
  when there are more workers than GPUs; the torch engine drives one GPU, so never more), and
  the trainer takes one GPU of the rest. Ray assigns the devices (in creation order: the
  generation workers, created first, usually get GPUs 0..k-1); any GPU beyond k + 1 idles.
- GPU, colocated: generation and training share the GPU (half a GPU each as far as Ray's
  accounting goes); the engine stands down for every train step, or with
  ``colocated.stand_down: false`` keeps decoding beside the trainer (on one GPU the two
  processes' kernels then overlap only under CUDA MPS; without it the GPU time-slices them).
- On-policy distillation: each teacher worker is one more process with the same CPU share on
  a CPU run; on a GPU run it takes ``gpus_per_worker`` GPUs of its own, or with
  ``colocated_with_trainer`` shares the trainer's GPU (half of its share, split over the
  colocated workers).
- PPO: the critic (value worker) splits the policy trainer's share in half (on 2 CPUs: one CPU
  generates, the policy trainer and the critic hold 0.5 each). The two never compute at the
  same time for long — a PPO step runs the critic stages, then the policy epochs — so they
  share the training core or GPU instead of taking one from generation.

- Sharded trainer (``policy.dtensor_cfg.data_parallel_size`` N > 1; on a GPU run not
  colocated, N defaults to every GPU generation leaves): N ranks, each with the per-process
  share above (one GPU each on GPUs), in one placement group of N bundles packed per node
  (``launch_trainer_group``); with PPO each bundle holds a critic rank beside the policy rank.
- ``cluster.actor_resources``: custom Ray resources the controller, each generation worker and
  each trainer rank ask for, so that a multi-node cluster places each role on the nodes that
  offer its resources (docs/multinode.md).

The controller actor reserves no CPU: it spends its time waiting on the workers.

Every actor is created with ``enable_task_events=cluster.ray_task_events`` (off by default):
a call then leaves no record in Ray's task-event store in the GCS, which otherwise grows with
every call of a long run (docs/long_runs.md).

Weight sync: ``policy.generation.weight_sync`` is settled here from the cluster's GPUs
(``tandemrl.config.weight_sync``) and handed to the controller actor, which builds the
synchroniser (``tandemrl.controller.actor.make_weight_sync``).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandemrl.checkpoint.restore import RestorePlan, plan_restore
from tandemrl.config.distillation import teacher_name
from tandemrl.config.models import MasterConfig
from tandemrl.config.weight_sync import facts_from_config, resolve_weight_sync
from tandemrl.controller.actor import SingleControllerActor
from tandemrl.generation import engine_options
from tandemrl.generation.worker import make_generation_worker_class
from tandemrl.models import resolve_model_path
from tandemrl.training.policy_worker import create_policy_worker_actor
from tandemrl.training.teacher_worker import create_teacher_worker_actor
from tandemrl.training.trainer_group import ShardedTrainer, create_rank_actor
from tandemrl.training.value_worker import create_value_worker_actor

log = logging.getLogger(__name__)


class PlacementError(ValueError):
    """The cluster cannot hold the processes the config asks for."""


@dataclass(frozen=True)
class Placement:
    """What each process reserves; the trainer figures are per rank (``trainer_ranks`` of
    them, each with a PPO critic rank beside it)."""

    generation_cpus: float
    generation_gpus: float
    trainer_cpus: float
    trainer_gpus: float
    value_cpus: float = 0.0  # PPO critic; 0 on GRPO
    value_gpus: float = 0.0
    trainer_ranks: int = 1  # policy.dtensor_cfg.data_parallel_size, settled
    # On-policy distillation: (cpus, gpus) of each worker of each teacher, in teacher order.
    teachers: tuple[tuple[float, float], ...] = ()


def plan_placement(cfg: MasterConfig, *, cluster_cpus: float, cluster_gpus: float) -> Placement:
    placement = _plan_policy_placement(cfg, cluster_cpus=cluster_cpus, cluster_gpus=cluster_gpus)
    if cfg.is_distillation:
        return _plan_teacher_placement(cfg, placement, cluster_gpus=cluster_gpus)
    if not cfg.is_ppo:
        return placement
    cpus, gpus = placement.trainer_cpus / 2, placement.trainer_gpus / 2
    return Placement(
        placement.generation_cpus,
        placement.generation_gpus,
        cpus,
        gpus,
        cpus,
        gpus,
        placement.trainer_ranks,
    )


def trainer_ranks(cfg: MasterConfig, *, uses_gpu: bool, trainer_gpus: int) -> int:
    """``policy.dtensor_cfg.data_parallel_size``, or its default: every GPU the placement
    leaves the trainer on a GPU run (not colocated), 1 otherwise."""
    ranks = cfg.policy.dtensor_cfg.data_parallel_size
    if ranks is not None:
        if uses_gpu and ranks > trainer_gpus:
            raise PlacementError(
                f"policy.dtensor_cfg.data_parallel_size={ranks} trainer ranks need a GPU each, "
                f"but the placement leaves the trainer {trainer_gpus} GPU(s); lower it, or "
                "give generation fewer GPUs (policy.generation.colocated.resources.gpus_per_node)"
            )
        return ranks
    # Distillation teachers may need the GPUs generation leaves: one rank unless set.
    if not uses_gpu or cfg.policy.generation.colocated.enabled or cfg.is_distillation:
        return 1
    return max(trainer_gpus, 1)


def _teacher_workers(cfg: MasterConfig) -> int:
    block = cfg.on_policy_distillation
    return 0 if block is None else sum(teacher.num_workers for teacher in block.teachers)


def _plan_teacher_placement(
    cfg: MasterConfig, placement: Placement, *, cluster_gpus: float
) -> Placement:
    """Teacher workers: a CPU share like every other process on a CPU run (or for a
    ``device: cpu`` teacher); on a GPU run ``gpus_per_worker`` GPUs of their own, or with
    ``colocated_with_trainer`` half of the trainer's share, split over their workers."""
    block = cfg.on_policy_distillation
    assert block is not None
    on_gpus = uses_gpus(cfg, cluster_gpus=cluster_gpus)
    cpus = placement.generation_cpus  # the per-process CPU share of the run
    trainer_gpus = placement.trainer_gpus
    colocated_workers = sum(
        teacher.num_workers
        for teacher in block.teachers
        if on_gpus and teacher.device != "cpu" and teacher.colocated_with_trainer
    )
    if colocated_workers:
        trainer_gpus = placement.trainer_gpus / 2
    shares: list[tuple[float, float]] = []
    own_gpus = 0.0
    for index, teacher in enumerate(block.teachers):
        if not on_gpus or teacher.device == "cpu":
            if teacher.device == "cuda":
                raise PlacementError(
                    f"on_policy_distillation.teachers.{index}.device: cuda, but this run places "
                    f"nothing on GPUs (policy.device: {cfg.policy.device}, {int(cluster_gpus)} "
                    "GPU(s) in the cluster); set it to auto or cpu"
                )
            gpus = 0.0
        elif teacher.colocated_with_trainer:
            gpus = placement.trainer_gpus / 2 / colocated_workers
        else:
            gpus = teacher.gpus_per_worker
            own_gpus += gpus * teacher.num_workers
        shares += [(cpus, gpus)] * teacher.num_workers
    taken = placement.generation_gpus * cfg.policy.generation.num_workers
    if not cfg.policy.generation.colocated.enabled:
        taken += placement.trainer_gpus
    else:
        taken = placement.trainer_gpus  # generation shares the trainer's GPU
    if own_gpus and taken + own_gpus > cluster_gpus + 1e-9:
        raise PlacementError(
            f"the teachers' own GPUs (on_policy_distillation.teachers.*.gpus_per_worker x "
            f"num_workers = {own_gpus:g}) do not fit beside generation and the trainer "
            f"({taken:g} GPU(s)) in a cluster of {int(cluster_gpus)}; lower them, or set "
            "colocated_with_trainer: true to share the trainer's GPU"
        )
    return Placement(
        placement.generation_cpus,
        placement.generation_gpus,
        placement.trainer_cpus,
        trainer_gpus,
        trainer_ranks=placement.trainer_ranks,
        teachers=tuple(shares),
    )


def uses_gpus(cfg: MasterConfig, *, cluster_gpus: float) -> bool:
    """Whether the run's processes take GPUs: ``policy.device`` decides; ``auto`` follows the
    cluster. ``cuda`` on a cluster without GPUs is refused, naming the keys to change."""
    device = cfg.policy.device
    if device == "cpu":
        return False
    if cluster_gpus > 0:
        return True
    if device == "cuda":
        raise PlacementError(
            "policy.device: cuda, but the Ray cluster has no GPU"
            + (
                " (cluster.num_gpus: 0)"
                if cfg.cluster.num_gpus == 0
                else " (torch sees none on this machine)"
            )
            + "; set policy.device: cpu (or auto) to train on the CPU, or run where a GPU is "
            "visible"
        )
    return False


def _plan_policy_placement(
    cfg: MasterConfig, *, cluster_cpus: float, cluster_gpus: float
) -> Placement:
    workers = cfg.policy.generation.num_workers
    colocated = cfg.policy.generation.colocated
    if not uses_gpus(cfg, cluster_gpus=cluster_gpus):
        if colocated.resources.gpus_per_node > 0:
            raise PlacementError(
                f"policy.generation.colocated.resources.gpus_per_node="
                f"{colocated.resources.gpus_per_node} asks for generation GPUs, but this is a "
                f"CPU run (policy.device: {cfg.policy.device}, {int(cluster_gpus)} GPU(s) in "
                "the cluster); set it to 0, or policy.device: cuda on a machine with GPUs"
            )
        ranks = trainer_ranks(cfg, uses_gpu=False, trainer_gpus=0)
        processes = workers + ranks + _teacher_workers(cfg)
        cpus_each = 1.0 if cluster_cpus >= processes else cluster_cpus / processes
        return Placement(cpus_each, 0.0, cpus_each, 0.0, trainer_ranks=ranks)
    processes = workers + 1 + _teacher_workers(cfg)
    cpus_each = 1.0 if cluster_cpus >= processes else cluster_cpus / processes
    if colocated.enabled:
        if (cfg.policy.dtensor_cfg.data_parallel_size or 1) > 1:
            raise PlacementError(
                "policy.generation.colocated.enabled: true needs "
                "policy.dtensor_cfg.data_parallel_size: 1 (one trainer rank shares the GPU)"
            )
        return Placement(cpus_each, 0.5 / workers, cpus_each, 0.5)
    generation_gpus = colocated.resources.gpus_per_node
    gpus = int(cluster_gpus)
    if gpus < 2:
        raise PlacementError(
            f"a GPU run with generation on GPUs of its own (policy.generation.colocated.enabled: "
            f"false) needs at least 2 GPUs, one to generate and one to train; the cluster has "
            f"{gpus}. On one GPU set policy.generation.colocated.enabled: true (generation and "
            "training share it); to train on the CPU set policy.device: cpu"
        )
    if generation_gpus < 1 or generation_gpus >= cluster_gpus:
        raise PlacementError(
            f"policy.generation.colocated.resources.gpus_per_node={generation_gpus}: with "
            f"generation on GPUs of its own (colocated.enabled: false) and {gpus} GPUs in the "
            f"cluster, give generation 1 to {gpus - 1} of them (the trainer takes one of the "
            f"rest), e.g. policy.generation.colocated.resources.gpus_per_node=1"
        )
    if generation_gpus > workers:
        raise PlacementError(
            f"policy.generation.colocated.resources.gpus_per_node={generation_gpus} GPUs for "
            f"policy.generation.num_workers={workers} worker(s): a torch generation worker drives "
            f"one GPU, so set num_workers to {generation_gpus} (one per GPU) or fewer GPUs"
        )
    left = int(cluster_gpus - generation_gpus)
    ranks = trainer_ranks(cfg, uses_gpu=True, trainer_gpus=left)
    if left - ranks >= 1:
        log.warning(
            "%d GPU(s) of the cluster stay idle: generation takes %d, the trainer %d",
            left - ranks,
            generation_gpus,
            ranks,
        )
    return Placement(cpus_each, generation_gpus / workers, cpus_each, 1.0, trainer_ranks=ranks)


# How long the driver waits for Ray to remove the trainer ranks' placement group at shutdown
# (it can block on a cluster that is going away).
PLACEMENT_GROUP_REMOVAL_S = 10.0


# Longest wait for the run's actors to be killed at the end (a Ray call that needs the GCS
# never answers once the GCS is gone).
TEARDOWN_DEADLINE_S = 10.0


def call_with_deadline(call: Callable[[], object], *, deadline_s: float, what: str) -> bool:
    """Run ``call`` on a daemon thread and wait at most ``deadline_s`` for it; False (with a
    warning naming ``what``) when it did not return in time. An exception it raises is
    logged: teardown goes on with the next step."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # logged below: the teardown goes on
            failure.append(exc)

    thread = threading.Thread(target=target, name=f"teardown: {what}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        log.warning("%s did not finish within %g s; going on without it", what, deadline_s)
        return False
    if failure:
        log.warning("%s failed: %r", what, failure[0])
        return False
    return True


@dataclass
class Launched:
    controller: Any
    # The policy trainer's actor handle, or a ShardedTrainer over its ranks' actors.
    trainer: Any
    engines: list[Any]
    resume_step: int = 0
    _cleanup: list[Callable[[], None]] = field(default_factory=list)
    value_trainer: Any = None  # PPO: the critic's actor handle (or ShardedTrainer)
    # On-policy distillation: each teacher's worker actors, in teacher order.
    teachers: list[list[Any]] = field(default_factory=list)
    placement_group: Any = None  # the trainer ranks' bundles (sharded trainers only)

    def actor_handles(self) -> list[Any]:
        handles = [self.controller, *self.engines]
        for trainer in (self.trainer, self.value_trainer):
            if isinstance(trainer, ShardedTrainer):
                handles.extend(trainer.ranks)
            elif trainer is not None:
                handles.append(trainer)
        return handles + [handle for workers in self.teachers for handle in workers]

    def save_final_model(self, directory: str) -> str:
        """The trained policy as a transformers folder (rank 0 writes it when sharded)."""
        import ray

        if isinstance(self.trainer, ShardedTrainer):
            return self.trainer.save_final_model_blocking(directory)
        return str(ray.get(self.trainer.save_final_model.remote(directory)))

    def shutdown(self, *, deadline_s: float = TEARDOWN_DEADLINE_S) -> bool:
        """Kill the run's actors; False when Ray did not answer within ``deadline_s``."""
        import ray

        handles = self.actor_handles()
        group = self.placement_group

        def teardown() -> None:
            for handle in handles:
                ray.kill(handle, no_restart=True)
            if group is not None:
                ray.util.remove_placement_group(group)

        return call_with_deadline(teardown, deadline_s=deadline_s, what="killing the run's actors")


def _resources(amounts: dict[str, float]) -> dict[str, Any]:
    """``.options()`` keywords asking for the custom resources ``amounts`` (none: nothing)."""
    return {"resources": dict(amounts)} if amounts else {}


def launch_trainer_group(
    cfg: MasterConfig,
    placement: Placement,
    model_path: str,
    *,
    uses_gpu: bool,
    actor_options: dict[str, Any] | None = None,
) -> tuple[ShardedTrainer, ShardedTrainer | None, Any]:
    """The policy trainer's ranks (and the PPO critic's, one beside each) in one placement
    group of ``placement.trainer_ranks`` bundles packed per node; joined and built on return.

    Each bundle holds one policy rank and, in PPO, one critic rank, and asks for the trainer's
    custom resources (``cluster.actor_resources.trainer``). CPU ranks see no GPU (gloo FSDP2
    and visible GPUs do not mix: pytorch #132471).
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ranks = placement.trainer_ranks
    timeout_s = cfg.policy.dtensor_cfg.timeout_s
    bundle: dict[str, float] = {
        "CPU": placement.trainer_cpus + placement.value_cpus,
        **cfg.cluster.actor_resources.trainer,
    }
    if uses_gpu:
        bundle["GPU"] = placement.trainer_gpus + placement.value_gpus
    group = placement_group([dict(bundle) for _ in range(ranks)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise PlacementError(
            f"the cluster cannot place {ranks} trainer ranks of {bundle} each within "
            f"{timeout_s:g} s (policy.dtensor_cfg.data_parallel_size={ranks}, "
            f"cluster.actor_resources.trainer={cfg.cluster.actor_resources.trainer}); see "
            "`ray status` for what the nodes offer"
        )
    runtime_env = {} if uses_gpu else {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
    backend = "nccl" if uses_gpu else "gloo"
    run_id = uuid.uuid4().hex[:8]

    def ranks_of(kind: str, cpus: float, gpus: float) -> list[Any]:
        # Named (``ray list actors`` shows policy-rank-1-<run>), never reused across runs.
        return [
            create_rank_actor(
                kind,
                rank,
                ranks,
                timeout_s,
                num_cpus=cpus,
                num_gpus=gpus,
                name=f"{kind}-rank-{rank}-{run_id}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank),
                **runtime_env,
                **(actor_options or {}),
            )
            for rank in range(ranks)
        ]

    algo = cfg.algorithm
    policy = ShardedTrainer(
        ranks_of("policy", placement.trainer_cpus, placement.trainer_gpus),
        role="policy trainer",
        token_level_loss=cfg.loss_fn.token_level_loss,
    )
    policy_kwargs = {
        "policy_cfg": cfg.policy,
        "loss_cfg": cfg.loss_fn,
        "model_path": model_path,
        "seed": algo.seed,
        "torch_num_threads": 1,
    }
    critic = None
    critic_kwargs: dict[str, Any] = {}
    if cfg.is_ppo:
        assert cfg.value is not None and cfg.value_loss_fn is not None  # validation
        critic = ShardedTrainer(
            ranks_of("value", placement.value_cpus, placement.value_gpus), role="critic"
        )
        critic_kwargs = {
            "value_cfg": cfg.value,
            "loss_cfg": cfg.value_loss_fn,
            "model_path": None if cfg.value.model_name is not None else model_path,
            "seed": algo.seed,
            "device": cfg.policy.device,
            "precision": cfg.policy.precision,
            "activation_checkpointing": cfg.policy.dtensor_cfg.activation_checkpointing,
            "torch_num_threads": 1,
        }
    try:
        policy.start(policy_kwargs, backend)
        if critic is not None:
            critic.start(critic_kwargs, backend)
    except BaseException:
        for trainer in (policy, critic):
            for handle in [] if trainer is None else trainer.ranks:
                ray.kill(handle, no_restart=True)
        ray.util.remove_placement_group(group)
        raise
    log.info("trainer group: %d rank(s) over %s", ranks, backend)
    return policy, critic, group


def launch(
    cfg: MasterConfig, plan: RestorePlan | None = None, *, overwrite_logs: bool = False
) -> Launched:
    """Start the workers and the controller actor (``run`` is not called yet). ``plan``: what
    to resume, decided read-only before (``plan_restore``); ``overwrite_logs``: the run may
    replace another run's files in ``logger.log_dir``."""
    import ray

    if plan is None:
        plan = plan_restore(cfg)

    resources = ray.cluster_resources()  # type: ignore[no-untyped-call]  # unannotated in ray
    placement = plan_placement(
        cfg, cluster_cpus=resources.get("CPU", 1.0), cluster_gpus=resources.get("GPU", 0.0)
    )
    cluster_gpus = resources.get("GPU", 0.0)
    try:
        weight_sync = resolve_weight_sync(
            cfg,
            facts_from_config(
                cfg, cluster_gpus=cluster_gpus, trainer_ranks=placement.trainer_ranks
            ),
        )
    except ValueError as exc:
        raise PlacementError(str(exc)) from exc
    model_path = str(resolve_model_path(cfg.policy.model_name))
    log.info("model %s; placement %s; weight sync %s", model_path, placement, weight_sync)
    algo = cfg.algorithm
    backend = cfg.policy.generation.backend
    if backend not in ("torch", "vllm"):
        raise PlacementError(
            f"policy.generation.backend={backend!r} cannot be launched on Ray (it is for tests); "
            "use 'torch' or 'vllm'"
        )
    worker_class = make_generation_worker_class(
        num_cpus=placement.generation_cpus, num_gpus=placement.generation_gpus
    )
    options = engine_options(
        cfg.policy,
        recompute_kv_cache_after_weight_updates=cfg.async_rl.recompute_kv_cache_after_weight_updates,
        seed=algo.seed,
    )
    # No record per call in the GCS (cluster.ray_task_events); see the module docstring.
    events = {"enable_task_events": cfg.cluster.ray_task_events}
    engines = [
        worker_class.options(**_resources(cfg.cluster.actor_resources.generation), **events).remote(
            model_path,
            backend=backend,
            policy_cfg=cfg.policy,
            **{**options, "seed": algo.seed + index},
        )
        for index in range(cfg.policy.generation.num_workers)
    ]
    trainer: Any
    value_trainer: Any = None
    group = None
    if placement.trainer_ranks > 1:
        try:
            trainer, value_trainer, group = launch_trainer_group(
                cfg,
                placement,
                model_path,
                uses_gpu=uses_gpus(cfg, cluster_gpus=cluster_gpus),
                actor_options=events,
            )
        except BaseException:
            for engine in engines:
                ray.kill(engine, no_restart=True)
            raise
    else:
        trainer = create_policy_worker_actor(
            cfg.policy,
            cfg.loss_fn,
            model_path=model_path,
            seed=algo.seed,
            num_cpus=placement.trainer_cpus,
            num_gpus=placement.trainer_gpus,
            **_resources(cfg.cluster.actor_resources.trainer),
            **events,
        )
    if cfg.is_ppo and placement.trainer_ranks == 1:
        assert cfg.value is not None and cfg.value_loss_fn is not None  # validation
        value_trainer = create_value_worker_actor(
            cfg.value,
            cfg.value_loss_fn,
            # value.model_name null: the policy's model with a fresh value head.
            model_path=None if cfg.value.model_name is not None else model_path,
            seed=algo.seed,
            device=cfg.policy.device,
            precision=cfg.policy.precision,
            activation_checkpointing=cfg.policy.dtensor_cfg.activation_checkpointing,
            num_cpus=placement.value_cpus,
            num_gpus=placement.value_gpus,
            **_resources(cfg.cluster.actor_resources.trainer),
            **events,
        )
    teachers = launch_teachers(cfg, placement)
    controller = (
        ray.remote(num_cpus=0, max_concurrency=8)(SingleControllerActor)  # type: ignore[call-overload]  # ray types no actor options here
        .options(name=None, **_resources(cfg.cluster.actor_resources.controller), **events)
        .remote(
            cfg,
            model_path,
            trainer,
            engines,
            plan,
            value_trainer_handle=value_trainer,
            teacher_handles=teachers,
            weight_sync=weight_sync,
            overwrite_logs=overwrite_logs,
        )
    )
    launched = Launched(
        controller=controller,
        trainer=trainer,
        engines=engines,
        resume_step=plan.step + 1 if not plan.fresh else 0,
        value_trainer=value_trainer,
        placement_group=group,
        teachers=teachers,
    )
    # Fail here, not mid-run, when a worker cannot start (bad model folder, no memory); the
    # ranks of a sharded trainer are built already.
    try:
        ray.get([engine.ping.remote() for engine in engines])
        for handle in (trainer, value_trainer):
            if handle is not None and not isinstance(handle, ShardedTrainer):
                ray.get(handle.get_state.remote())
        ray.get([worker.ping.remote() for workers in teachers for worker in workers])
    except BaseException:
        launched.shutdown()
        raise
    return launched


def launch_teachers(cfg: MasterConfig, placement: Placement) -> list[list[Any]]:
    """The teachers' worker actors, each with its share of ``placement.teachers``."""
    block = cfg.on_policy_distillation
    if block is None:
        return []
    shares = iter(placement.teachers)
    teachers = []
    for index, teacher in enumerate(block.teachers):
        model_path = str(resolve_model_path(teacher.model_name))
        workers = []
        for _ in range(teacher.num_workers):
            cpus, gpus = next(shares)
            device = teacher.device
            if device == "auto":
                device = "cuda" if gpus > 0 else "cpu"
            workers.append(
                create_teacher_worker_actor(
                    model_path,
                    num_cpus=cpus,
                    num_gpus=gpus,
                    name=teacher_name(teacher, index),
                    device=device,
                    precision=teacher.precision,
                    micro_batch_size=teacher.micro_batch_size,
                    colocated_with_trainer=teacher.colocated_with_trainer,
                )
            )
        teachers.append(workers)
    return teachers
