"""Typed models of the master config: every key a user may write, with its default.

The keys follow the reference spec (``policy.generation.*``, ``grpo.*``, ``ppo.*``,
``on_policy_distillation.*``, ``value.*``, ``loss_fn.*``, ``async_rl.*``, ``data_plane.*``,
``checkpointing.*``, ``rollout_checkpointing.*``, ``token_capture.*``, ``rollout_recovery.*``)
plus this project's ``data``, ``env``, ``cluster`` and ``logger`` blocks. Every model forbids
unknown keys; cross-field rules live in ``validate.py`` so
that all violations can be reported together.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator


class Strict(BaseModel):
    """Base for config blocks: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _yaml_switch(value: Any) -> Any:
    # YAML 1.1 reads a bare on/off as a boolean.
    return {True: "on", False: "off"}[value] if isinstance(value, bool) else value


# A three-way setting: "auto" (the code decides), "on" or "off"; a YAML on/off also works.
Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_yaml_switch)]


def _null_is_empty(value: Any) -> Any:
    # NeMo-RL writes `stop_token_ids: null` for "none".
    return [] if value is None else value


StopTokenIds = Annotated[list[int], BeforeValidator(_null_is_empty)]
StopStrings = Annotated[list[str], BeforeValidator(_null_is_empty)]


# --------------------------------------------------------------------------- policy


class TokenizerConfig(Strict):
    # None: load the tokenizer from policy.model_name.
    name: str | None = None


class ColocatedResources(Strict):
    num_nodes: int = Field(1, ge=1)
    # Inference GPUs; the remainder of the node goes to training. 0 on CPU-only runs.
    gpus_per_node: int = Field(0, ge=0)


class ColocatedConfig(Strict):
    enabled: bool = False
    # While the trainer runs, a sleeping torch engine on CUDA frees its KV cache and CUDA
    # graphs (the trainer gets the memory; wake re-prefills the running rows and recaptures).
    # False: it only pauses and keeps both — for when the trainer fits beside the cache.
    free_cache_on_sleep: bool = True
    # True: the engine stands down for every train step (the devices do one thing at a time).
    # False: it keeps decoding while the trainer runs on the same devices, so a step need not
    # be one whole batch; on one GPU the two processes' kernels overlap only under CUDA MPS.
    stand_down: bool = True
    # With stand_down false on one GPU: a private CUDA MPS daemon for the run's processes, so
    # the engine's and the trainer's kernels run at once (tandemrl/controller/mps.py).
    mps: Literal["auto", "on", "off"] = "auto"
    resources: ColocatedResources = ColocatedResources()


class VllmConfig(Strict):
    async_engine: bool = False
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    enforce_eager: bool = True
    max_model_len: int | None = None


class TorchGenerationConfig(Strict):
    """The in-process torch engine (backend torch); see tandemrl/generation/torch_engine.py."""

    # Static-cache decode (CUDA graphs on CUDA): "auto" for Llama/Qwen2/Qwen3/Mistral/Phi-3
    # models (on CPU only while the preallocated cache fits in 256 MiB; the step then runs
    # eagerly), "on" (refused for other models), "off" (the transformers DynamicCache batch).
    cuda_graphs: Switch = "auto"
    # torch.compile the static step's fused elementwise work (CUDA only).
    compile: bool = True
    # Positions per slot of the static cache (prompt + completion); a sequence that reaches it
    # ends with finish_reason "length". None: the model's max_position_embeddings, at most 4096.
    max_seq_len: int | None = Field(None, ge=2)
    # Share of the free device memory the static cache may take; fewer slots than
    # max_batch_size when it holds fewer.
    kv_cache_memory_fraction: float = Field(0.5, gt=0.0, le=1.0)
    # Queued requests join the running batch once this many rows are free (or all of them
    # fit, or nothing runs): fewer, larger prefill passes. None: a quarter of the batch's rows
    # (max_batch_size, or the static cache's slots when it holds fewer).
    admission_batch: int | None = Field(None, ge=1)
    # Static path: decode steps queued per launch (one CUDA graph replay, one host wait):
    # less host work per token, at the cost of rows that finish waiting for the launch's end.
    steps_per_launch: int = Field(1, ge=1)


class HttpServerConfig(Strict):
    """The OpenAI-compatible policy endpoint agents talk to (tandemrl/agents/server.py)."""

    # Serve it (in the controller's process, in front of the generation workers); agents get
    # an HTTP client pointed at it (env.agent.client: auto).
    enabled: bool = False
    # Loopback by default; an address (or 0.0.0.0) for agents on other nodes.
    host: str = "127.0.0.1"
    # 0: a free port, picked when the server starts.
    port: int = Field(0, ge=0, le=65535)
    # The one `model` a request may name; GET /v1/models lists it.
    served_model_name: str = Field("policy", min_length=1)
    # A request body above this many bytes is refused (400).
    max_request_bytes: int = Field(1_048_576, ge=1024)
    # True: a request may ask for another temperature/top_p than policy.generation's (the
    # logprobs are then those of the requested distribution); false refuses it (400).
    allow_sampling_overrides: bool = False


class GenerationConfig(Strict):
    backend: Literal["torch", "vllm", "megatron", "fake"] = "torch"
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(16, ge=1)
    stop_token_ids: StopTokenIds = []
    stop_strings: StopStrings = []
    # Number of generation worker processes (Ray actors).
    num_workers: int = Field(1, ge=1)
    # Largest number of sequences one engine decodes together.
    max_batch_size: int = Field(256, ge=1)
    vllm_cfg: VllmConfig = VllmConfig()
    torch: TorchGenerationConfig = TorchGenerationConfig()
    colocated: ColocatedConfig = ColocatedConfig()
    # How the trainer's weights reach the generation workers after each step (Ray runs):
    # "object_store" (a CPU copy through Ray's object store), "cuda_ipc" (workers map the
    # trainer's GPU buffer; trainer and workers on one GPU), "nccl" (a broadcast from the
    # trainer; over gloo on CPU), or "auto" (cuda_ipc when they share a GPU, nccl when each
    # has its own, object_store on CPU). See tandemrl/config/weight_sync.py.
    weight_sync: Literal["auto", "object_store", "cuda_ipc", "nccl"] = "auto"
    # Longest wait of one weight sync on any process (cuda_ipc, nccl); a dead or stuck peer
    # ends the wait with an error naming this key.
    weight_sync_timeout_s: float = Field(120.0, gt=0.0)
    # Only for backend "fake" (tests and benchmarks): per-request latency model.
    fake_latency: dict[str, Any] | None = None
    # The reference spec's expose_http_server: an OpenAI-compatible endpoint for agents.
    http_server: HttpServerConfig = HttpServerConfig()
    # Sampling of validation passes (grpo/ppo.val_*): greedy (0) by default. Top-k is not
    # supported by the engines: val_top_k may only be null, <= 0 (off), or 1 (greedy).
    val_temperature: float = Field(0.0, ge=0.0)
    val_top_p: float = Field(1.0, gt=0.0, le=1.0)
    val_top_k: int | None = None


class DTensorConfig(Strict):
    enabled: bool = True
    activation_checkpointing: bool = False
    # Ranks of the policy trainer (and of the PPO critic): each a process of its own that
    # shards the model with FSDP2 (tandemrl/training/trainer_group.py); 1 trains in one
    # process. None: every GPU the placement gives the trainer on a GPU run, 1 on CPU.
    data_parallel_size: int | None = Field(None, ge=1)
    # Longest wait of a trainer rank on the others: the rendezvous and every collective.
    timeout_s: float = Field(600.0, gt=0.0)
    # FSDP2's reshard_after_forward for every decoder layer: free the gathered weights after
    # the forward and gather them again for the backward (true: less memory), or keep them
    # until the backward is done (false: one gather a step, the whole model's gathered
    # weights held from the forward to the backward). None: true with several ranks, false
    # with one (its "gather" is only the bf16 cast, and it is the one copy there is).
    reshard_after_forward: bool | None = None


class MegatronConfig(Strict):
    enabled: bool = False


class OptimizerConfig(Strict):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)


class SchedulerConfig(Strict):
    name: Literal["constant", "linear_warmup"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    # linear_warmup: the lr factor of the first step, rising linearly to 1 at warmup_steps
    # (torch's LinearLR). None: (step + 1) / warmup_steps.
    start_factor: float | None = Field(None, ge=0.0, le=1.0)


class PolicyConfig(Strict):
    # A local transformers causal-LM folder, or "tiny://<preset>" for a built-in tiny model
    # created on first use in the model cache folder.
    model_name: str = "tiny://qwen2-counting"
    tokenizer: TokenizerConfig = TokenizerConfig()
    train_global_batch_size: int = Field(128, ge=1)
    train_micro_batch_size: int = Field(64, ge=1)
    max_total_sequence_length: int = Field(64, ge=2)
    # "auto": bfloat16 on CUDA, float32 on CPU.
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    generation: GenerationConfig = GenerationConfig()
    dtensor_cfg: DTensorConfig = DTensorConfig()
    megatron_cfg: MegatronConfig = MegatronConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    offload_optimizer_for_logprob: bool = False
    # Padded-token budget of one training micro-batch (rows x longest row, rows sorted by
    # length; real tokens when the rows are packed, see sequence_packing); None:
    # train_micro_batch_size rows each. When set, both limits apply.
    train_micro_batch_tokens: int | None = Field(None, ge=1)
    # torch.compile every decoder layer of the trainer (dynamic shapes; pays on CUDA, where
    # it fuses the elementwise work between the matrix products).
    compile_layers: bool = False
    # Padding-free training micro-batches: each micro-batch's rows packed into one sequence
    # with attention kept within rows (tandemrl/training/packing.py); the token budget then
    # counts real tokens. "auto": on where it pays (CUDA with torch's varlen attention and a
    # supported model), "on": always (CPU uses a reference attention; an unsupported model
    # is refused), "off": padded micro-batches.
    sequence_packing: Switch = "auto"
    # A vision-language model (policy.model_name an image-text-to-text folder or
    # tiny://qwen2-vl): prompts carry images (data.image_key), processed by the model's own
    # processor; docs/vlm.md.
    is_vlm: bool = False


# --------------------------------------------------------------------------- algorithms


class RewardScalingConfig(Strict):
    """``reward_scaling``: each reward clamped to [source_min, source_max], then mapped
    linearly onto [target_min, target_max] (NeMo-RL's keys and defaults)."""

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


class RewardShapingConfig(Strict):
    """``reward_shaping``: DAPO's overlong penalty by completion length, or NeMo-RL's
    stop-properly penalty on truncated completions (tandemrl/training/rewards.py)."""

    enabled: bool = False
    # Overlong penalty: a completion longer than max_response_length - overlong_buffer_length
    # tokens loses overlong_buffer_penalty x (excess / overlong_buffer_length).
    overlong_buffer_length: int | None = Field(None, ge=1)
    overlong_buffer_penalty: float | None = Field(None, ge=0.0)
    max_response_length: int | None = Field(None, ge=1)
    # Instead: a truncated completion's reward is multiplied by this factor (0: no reward).
    stop_properly_penalty_coef: float | None = Field(None, ge=0.0, le=1.0)


class AlgorithmCommon(Strict):
    num_prompts_per_step: int = Field(16, ge=1)
    num_generations_per_prompt: int = Field(8, ge=1)
    max_num_steps: int = Field(100, ge=1)
    # Must be positive: the rollout pump stops when the epoch counter reaches it.
    max_num_epochs: int = 1000
    seed: int = 42
    # Validation passes over data.validation (tandemrl/controller/validation.py): every
    # val_period trainer versions (0: none), of the initial weights (val_at_start) and of the
    # final ones (val_at_end).
    val_period: int = Field(0, ge=0)
    val_at_start: bool = False
    val_at_end: bool = False
    # Held-out prompts per pass: the first max_val_samples of data.validation (None: all).
    max_val_samples: int | None = Field(None, ge=1)
    # Validation prompts in flight at once, out of async_rl.max_inflight_prompts (training
    # keeps the rest). None: a quarter of max_inflight_prompts, at least 1.
    val_batch_size: int | None = Field(None, ge=1)
    # Completions per validation prompt: the k of val/pass@k.
    val_num_generations: int = Field(1, ge=1)
    # Applied to every completion's reward before it is stored: scaling, then shaping.
    reward_shaping: RewardShapingConfig | None = None
    reward_scaling: RewardScalingConfig | None = None
    # GRPO: DAPO dynamic sampling. A selected group whose rewards are all equal (advantage 0
    # for every member) is dropped and the step keeps filling from the buffer; a step drops at
    # most (dynamic_sampling_max_gen_batches - 1) x num_prompts_per_step groups, beyond which
    # it trains what comes (tandemrl/controller/dynamic_sampling.py).
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    # Exclude truncated completions (hit max_new_tokens) from the loss through sample_mask.
    overlong_filtering: bool = False


class GRPOConfig(AlgorithmCommon):
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
    # Legacy async block: must be null on the single-controller path.
    async_grpo: dict[str, Any] | None = None


class AdvEstimatorConfig(Strict):
    name: Literal["gae", "grpo"] = "gae"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lambda_: float = Field(0.95, ge=0.0, le=1.0, alias="lambda")
    normalize_advantages: bool = True

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class PPOConfig(AlgorithmCommon):
    num_generations_per_prompt: int = Field(1, ge=1)
    ppo_epochs: int = 1
    critic_ppo_epochs: int = 1
    policy_training_start_step: int = Field(0, ge=0)
    warm_start_value_checkpoint: str | None = None
    adv_estimator: AdvEstimatorConfig = AdvEstimatorConfig()
    # Legacy async block: must be null on the single-controller path.
    async_ppo: dict[str, Any] | None = None


class TeacherConfig(Strict):
    """One teacher of an on-policy distillation run: a frozen model that scores the student's
    own tokens, and which rows it serves (``task_sources``, ``agent_refs``, or ``default``)."""

    # Its name in metrics and messages; None: "teacher<index>".
    name: str | None = None
    # A local transformers causal-LM folder or a "tiny://<preset>"; its tokenizer must be the
    # student's (checked by validation for presets, before the run for folders).
    model_name: str
    # "auto": CUDA when the run trains on GPUs, else CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # "auto": bfloat16 on CUDA, float32 on CPU.
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    # Teacher worker processes (Ray actors); calls go to the one with the fewest outstanding.
    num_workers: int = Field(1, ge=1)
    # GPUs each worker takes on a GPU run, on devices of their own (colocated_with_trainer
    # false); a share below 1 packs several workers onto one GPU.
    gpus_per_worker: float = Field(1.0, gt=0.0, le=1.0)
    # GPU runs: the workers share the trainer's GPU (half of it in Ray's accounting) instead
    # of taking their own; a worker refuses to start when the GPU lacks room for its weights.
    colocated_with_trainer: bool = False
    # Sequences scored per forward pass.
    micro_batch_size: int = Field(64, ge=1)
    # Rows whose data.task_source_key value is one of these (first routing rule).
    task_sources: list[str] = []
    # Rows whose data.agent_ref_key value is one of these (second rule).
    agent_refs: list[str] = []
    # Rows no other rule matched (at most one teacher).
    default: bool = False


class OnPolicyDistillationConfig(AlgorithmCommon):
    """The student generates, a teacher scores the student's own tokens, and the student is
    trained toward it: per token t, A_t = -kl_coef * clamp(log p_student - log p_teacher)
    (+ reward_coef * the GRPO advantage of the environment reward), through the clipped
    policy loss (docs/distillation.md)."""

    teachers: list[TeacherConfig] = []
    # Weight of the per-token reverse-KL advantage.
    kl_coef: float = Field(1.0, ge=0.0)
    # Weight of the environment reward's group advantage mixed in (0: pure distillation).
    reward_coef: float = Field(0.0, ge=0.0)
    # The per-token log ratio student - teacher is clamped to +-this (None: unclamped).
    log_ratio_clamp: float | None = Field(10.0, gt=0.0)
    # The reward advantage (reward_coef > 0) as in grpo.*.
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
    # Where teachers score a group: "rollout" (a rollout-pump stage before the group commits,
    # overlapping training) or "train" (in the train pump, beside the trainer's own logprob
    # pass, before the loss). benchmarks/distill_placement.py measures both.
    teacher_scoring: Literal["rollout", "train"] = "rollout"


class ValueConfig(Strict):
    # None: same folder as policy.model_name, with a fresh scalar value head.
    model_name: str | None = None
    train_global_batch_size: int = Field(128, ge=1)
    train_micro_batch_size: int = Field(64, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    optimizer: OptimizerConfig = OptimizerConfig()


class ValueLossConfig(Strict):
    # Clip range of the value update around the old value estimate; None disables clipping.
    value_clip: float | None = Field(0.2, gt=0.0)
    loss_coef: float = Field(1.0, gt=0.0)


class ImportanceSamplingConfig(Strict):
    # tis: truncate per-token weights at `truncation`; icepop: zero tokens whose weight falls
    # outside [low, high]; seq-mask-tis: mask whole sequences whose geometric-mean weight falls
    # outside [low, high], then truncate per token.
    # untruncated: the raw per-token weights; none: every weight is 1.
    mode: Literal["tis", "icepop", "seq-mask-tis", "untruncated", "none"] = "tis"
    truncation: float = Field(2.0, gt=0.0)
    low: float = Field(0.5, gt=0.0)
    high: float = Field(2.0, gt=0.0)


class LossConfig(Strict):
    # The PPO ratio is clipped to [1 - ratio_clip_min, 1 + ratio_clip_max]; the two may differ
    # (DAPO's clip-higher: a larger ratio_clip_max).
    ratio_clip_min: float = Field(0.2, ge=0.0)
    ratio_clip_max: float = Field(0.2, ge=0.0)
    # Dual-clip PPO: on tokens with a negative advantage the loss is at most -c x A, so a huge
    # ratio cannot push the policy arbitrarily far. None: off; NeMo-RL's usual value is 3.
    ratio_clip_c: float | None = Field(None, gt=1.0)
    # beta of a KL penalty to a frozen reference policy (the initial weights of
    # policy.model_name, held by the policy worker): loss_t += beta x KL_t. 0: off.
    reference_policy_kl_penalty: float = Field(0.0, ge=0.0)
    # Per-token estimator of KL(pi || pi_ref) from the sampled token, with
    # logr = log pi_ref - log pi: k1 = -logr, k2 = logr^2 / 2, k3 = exp(logr) - 1 - logr.
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    # logr is clamped to [-input, input] and the per-token KL to [-output, output]; None: off.
    kl_input_clamp_value: float | None = Field(20.0, gt=0.0)
    kl_output_clamp_value: float | None = Field(10.0, gt=0.0)
    # In a master config it defaults to whether the sampler admits off-policy data
    # (MasterConfig._derive_defaults); False for a LossConfig built on its own.
    use_importance_sampling_correction: bool = False
    importance_sampling: ImportanceSamplingConfig = ImportanceSamplingConfig()
    token_level_loss: bool = True
    entropy_coef: float = Field(0.0, ge=0.0)
    # Take prev_logprobs from the training forward itself (detached) instead of a separate
    # get_logprobs pass. Exact when the step makes one optimizer step over its batch (GRPO;
    # PPO with ppo_epochs 1): every micro-batch's forward then runs on the pre-step weights.
    reuse_training_logprobs: bool = False


# --------------------------------------------------------------------------- async_rl


class InOrderSamplerConfig(Strict):
    name: Literal["in_order"]
    # 1 as in NeMo-RL, and the same whether or not the sampler block is written.
    max_lookahead_versions: int = Field(1, ge=0)
    # PPO critic warm-up only: lookahead while ppo.policy_training_start_step is in progress.
    warmup_lookahead_versions: int | None = Field(None, ge=0)


class WeightFifoSamplerConfig(Strict):
    name: Literal["weight_fifo"]
    max_staleness_versions: int = Field(1, ge=0)


class ReadyFirstSamplerConfig(Strict):
    name: Literal["ready_first"]
    max_staleness_versions: int = Field(1, ge=0)


class WindowedSamplerConfig(Strict):
    name: Literal["windowed"]
    max_staleness_versions: int = Field(1, ge=0)
    sample_freshest_first: bool = False
    # Cap dispatch at ceil(ratio x num_prompts_per_step) groups beyond what the window can
    # still train (tandemrl/samplers/windowed.py); None: ungated, the buffer is the only cap.
    over_sampling_ratio: float | None = Field(None, ge=0.0)


class CustomSamplerConfig(BaseModel):
    """``target: "module:ClassName"``; every other key is passed to the class's constructor."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: Literal["custom"]
    target: str

    def constructor_kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


SamplerConfig = Annotated[
    InOrderSamplerConfig
    | WeightFifoSamplerConfig
    | ReadyFirstSamplerConfig
    | WindowedSamplerConfig
    | CustomSamplerConfig,
    Field(discriminator="name"),
]

# The modes' names, as the config classes above spell them (for messages).
SAMPLER_MODES: tuple[str, ...] = tuple(
    get_args(model.model_fields["name"].annotation)[0]
    for model in get_args(get_args(SamplerConfig)[0])
)


class RolloutFailureConfig(Strict):
    # Infrastructure failures (worker died, timeout, transport): retried with capped backoff.
    max_infra_retries: int = Field(3, ge=0)
    # Data failures (reward/environment raised, malformed output).
    max_data_retries: int = Field(1, ge=0)
    backoff_initial_s: float = Field(0.5, ge=0.0)
    backoff_max_s: float = Field(10.0, ge=0.0)
    # Run-wide budget of prompts dropped after their retries ran out. 0: a drop ends the run.
    max_skipped_prompts: int = Field(0, ge=0)
    # Budget of drops in a row (reset by any commit). 0: a drop ends the run.
    max_consecutive_dropped_prompts: int = Field(0, ge=0)
    on_dropped_prompt: Literal["shrink", "replace"] = "shrink"
    # shrink: a step never trains fewer than ceil(num_prompts_per_step * this) groups.
    min_step_batch_fraction: float = Field(0.5, gt=0.0, le=1.0)
    # replace: how many spare prompts the replacement reserve holds.
    replacement_reserve_size: int = Field(0, ge=0)
    # Per-request deadlines; None disables. Clocks stop while a colocated engine stands down.
    generation_timeout_s: float | None = Field(None, gt=0.0)
    rollout_timeout_s: float | None = Field(None, gt=0.0)


class StallWatchdogConfig(Strict):
    enabled: bool = True
    # No step trained and no group committed for this long counts as a stall.
    timeout_s: float = Field(300.0, gt=0.0)
    action: Literal["warn", "abort"] = "warn"


class AsyncRLConfig(Strict):
    sampler: SamplerConfig = InOrderSamplerConfig(name="in_order")
    # The three sizes below default, in a master config, to values derived from
    # num_prompts_per_step and the sampler (MasterConfig._derive_defaults); the literals here
    # only apply to an AsyncRLConfig built on its own.
    min_groups_for_streaming_train: int = Field(16, ge=1)
    # Hard cap on unconsumed rollout groups (reserved + ready) held in the buffer.
    max_buffered_rollouts: int = Field(32, ge=1)
    # Backpressure cap on prompt groups being generated at once.
    max_inflight_prompts: int = Field(32, ge=1)
    recompute_kv_cache_after_weight_updates: bool = False
    # True: a weight sync reaches generation while requests are in flight (they finish on the
    # new weights). False: the drain gate — before each sync, admit nothing, let the requests
    # in flight finish on the old weights, sync, reopen; every completion then comes from
    # one weight version.
    in_flight_weight_updates: bool = True
    # Drain gate only: the longest wait for in-flight requests; the ones still generating
    # then are aborted and generated again on the new weights (0: abort at once).
    drain_timeout_s: float = Field(60.0, ge=0.0)
    rollout_failure: RolloutFailureConfig = RolloutFailureConfig()
    stall_watchdog: StallWatchdogConfig = StallWatchdogConfig()


# --------------------------------------------------------------------------- data plane, checkpoints


class DataPlaneConfig(Strict):
    enabled: bool = True
    backend: Literal["local", "simple", "mooncake"] = "local"
    # simple (TransferQueue) only:
    num_storage_units: int = Field(1, ge=1)
    call_timeout_s: float = Field(60.0, gt=0.0)
    # Custom Ray resources each TransferQueue actor asks for (pins them to the nodes that
    # offer them, e.g. {"storage_node": 1}).
    actor_resources: dict[str, float] = {}


class CheckpointingConfig(Strict):
    enabled: bool = False
    checkpoint_dir: str = "checkpoints/run"
    save_period: int = Field(10, ge=1)
    save_data_plane: bool = False
    save_optimizer: bool = True
    # Trainer checkpoints kept on disk (oldest removed first); None keeps all.
    keep_top_k: int | None = Field(None, ge=1)
    # A validation metric (e.g. val/reward_mean): the best trainer checkpoint by it is kept
    # besides the latest keep_top_k. None: no ranking.
    metric_name: str | None = None
    higher_is_better: bool = True
    # On SIGTERM/SIGINT: seconds to finish the step in flight and write the last checkpoint
    # before the run is stopped without one.
    preemption_grace_s: float = Field(120.0, gt=0.0)


class RolloutCheckpointingConfig(Strict):
    # None: periodic rollout snapshots off.
    snapshot_attempt_interval_s: float | None = Field(None, gt=0.0)
    keep_latest_k: int = 2
    restore_mode: str = "latest"
    extra_fingerprint_excluded_paths: list[str] = []
    # Write-ahead commit log: every finished group is fsynced before it becomes trainable and
    # a restart replays the log on top of the bundle it restores (docs/checkpointing.md).
    # Takes effect whenever checkpointing.enabled and save_data_plane are on and the sampler
    # keeps an authoritative replay index; it does nothing otherwise.
    commit_log: bool = True
    # A restart whose rollout state was generated under another config (a changed value
    # outside the operational list of checkpoint/fingerprint.py): "refuse" starts nothing and
    # modifies nothing; "drop_rollouts" resumes the model, optimizer, dataloader and sampler
    # position but generates the buffered and unfinished groups again; "keep" trains them as
    # they are (docs/checkpointing.md#a-restart-with-a-changed-config).
    on_config_change: Literal["refuse", "drop_rollouts", "keep"] = "refuse"


class TokenCaptureConfig(Strict):
    # Finished siblings (agent episodes too) are kept with their tokens in the ownership
    # ledger and the commit log, so a restart or a retry never regenerates them.
    enabled: bool = False
    # Agent episodes (env.name: agent): what to do when a turn's prompt does not start with
    # the previous turn's prompt + completion ids. split: the turn starts a new training row
    # (counted as agent/prefix_split_frac); error: the episode fails (a data failure).
    on_prefix_mismatch: Literal["split", "error"] = "split"


Granularity = Literal["sibling", "prompt_group"]


class RolloutRecoveryConfig(Strict):
    default_granularity: Granularity = "sibling"
    task_source_granularity_overrides: dict[str, Granularity] = {}
    agent_granularity_overrides: dict[str, Granularity] = {}


# --------------------------------------------------------------------------- project blocks


class DataConfig(Strict):
    # "builtin://counting", "builtin://math", or a JSONL file path. None: the counting task,
    # which validation accepts only with a tiny:// model and the counting environment, so a
    # real model never trains on the toy task by omission.
    dataset: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    task_source_key: str = "task_source"
    agent_ref_key: str = "agent_ref"
    # Built-in synthetic datasets: how many prompts one epoch holds.
    num_prompts: int = Field(4096, ge=1)
    shuffle: bool = True
    seed: int = 0
    # How a prompt reaches the model (tandemrl/data/prompt_format.py): "raw", its text as it
    # is; "chat", rendered by the tokenizer's chat template (add_generation_prompt) as a user
    # message, or the row's messages_key conversation.
    prompt_format: Literal["raw", "chat"] = "raw"
    # chat only: a system message put before every conversation that has none of its own.
    system_prompt: str | None = None
    # chat only: the JSONL field that may hold a whole conversation, a list of
    # {"role": ..., "content": ...}; a row with it needs no prompt_key field.
    messages_key: str = "messages"
    # policy.is_vlm only: the field holding a row's image(s) (a path, a data URI,
    # {"bytes": base64} or a nested pixel array; tandemrl/data/images.py), and the largest
    # image (width x height) a prompt may bring: a bigger one is a data failure of its prompt.
    image_key: str = "image"
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    # Held-out prompts for validation passes: a source like `dataset` (a JSONL file read with
    # the same *_key mapping, or a builtin://), never trained on. None: no validation data.
    validation: str | None = None


class AgentConfig(Strict):
    """Multi-turn agents (env.name: agent); see docs/agents.md."""

    # How an agent reaches the policy: http (an openai.AsyncOpenAI client on the endpoint,
    # policy.generation.http_server), in_process (a client with the same surface that calls
    # the policy directly), auto (http when the endpoint is enabled, else in_process).
    client: Literal["auto", "http", "in_process"] = "auto"
    # Calls (turns) one episode may make; the call after the last is refused (409) and the
    # episode ends truncated.
    max_turns: int = Field(8, ge=1)
    # Tokens one turn may generate (a request's max_tokens is cut to it); None:
    # policy.generation.max_new_tokens.
    max_tokens_per_turn: int | None = Field(None, ge=1)
    # Tokens the episode's turns may generate together; None: no limit beyond the context
    # (policy.max_total_sequence_length, prompt + completion of each call).
    max_tokens_per_episode: int | None = Field(None, ge=1)
    # Deadline of one call's generation, in awake time (frozen while a colocated engine stands
    # down); None: none. Passing it is an infrastructure failure of the episode.
    call_timeout_s: float | None = Field(None, gt=0.0)
    # Deadline of one whole agent run, in awake time; passing it is a data failure of the
    # sibling (an agent or tool that hangs).
    episode_timeout_s: float = Field(300.0, gt=0.0)
    # Worker processes (Ray actors) the episodes play in, each with its own agent and openai
    # client on the endpoint; 0: on the controller's event loop. The official client's CPU
    # per call is then off the controller (docs/agents.md). Needs the HTTP endpoint.
    workers: int = Field(0, ge=0)
    # CPUs Ray reserves for each agent worker (0: none; they share the node's cores).
    worker_num_cpus: float = Field(0.0, ge=0.0)


class GymHeadServerConfig(Strict):
    """A running NeMo-Gym head server (``gym env start``) to take the servers from."""

    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)


class NemoGymConfig(Strict):
    """env.name: nemo_gym: episodes played by NeMo-Gym's own agent and resources servers
    (docs/nemo_gym.md)."""

    # The Gym virtual environment (scripts/install_nemo_gym.sh DIR); None: the
    # TANDEMRL_NEMO_GYM_VENV environment variable.
    venv: str | None = None
    # Start the Gym servers: Gym config files (Gym's own +config_paths), relative ones resolved
    # as Gym does (against working_dir, then Gym's install folder).
    config_paths: list[str] = []
    # Gym global-config values merged after the files (like `gym env start ++key=value`),
    # e.g. {"policy_model": {"responses_api_models": {"vllm_model": {...}}}}.
    overrides: dict[str, Any] = {}
    # Or connect to servers started elsewhere: their head server (exclusive with config_paths).
    head_server: GymHeadServerConfig | None = None
    # The folder Gym runs in (it finds local servers and relative paths there); None: the
    # folder `tandemrl train` was started in.
    working_dir: str | None = None
    # The Gym model server whose backend is this run's policy endpoint.
    model_server: str = Field("policy_model", min_length=1)
    # Rows without an agent_ref go to this agent server; None: such a row is an error.
    default_agent: str | None = None
    # agent_ref -> the agent server that plays it (default: the agent_ref's own name).
    agent_routes: dict[str, str] = {}
    # Deadline of one /run (the whole episode inside Gym); passing it is an infrastructure
    # failure naming the Gym servers that stopped answering. Below env.agent.episode_timeout_s.
    run_timeout_s: float = Field(120.0, gt=0.0)
    # How long TandemRL waits for the Gym servers it starts to answer.
    startup_timeout_s: float = Field(600.0, gt=0.0)
    # A Gym server process that dies is started again (same port) up to this many times.
    max_server_restarts: int = Field(3, ge=0)


class EnvConfig(Strict):
    name: Literal["counting", "math", "custom", "agent", "nemo_gym"] = "counting"
    # env.name == custom: "module:ClassName" of an Environment subclass; env.name == agent:
    # "module:ClassName" of a tandemrl.agents.Agent subclass.
    target: str | None = None
    kwargs: dict[str, Any] = {}
    # env.name == custom or agent: directories put first on the import path of the process
    # that builds the environment (the controller actor), relative ones against its working
    # directory.
    python_path: list[str] = []
    # env.name == agent or nemo_gym: limits and deadlines of the agent episodes.
    agent: AgentConfig = AgentConfig()
    # env.name == nemo_gym: how to reach or start the Gym servers, and which agent plays a row.
    nemo_gym: NemoGymConfig = NemoGymConfig()


class ActorResourcesConfig(Strict):
    """Custom Ray resources (``ray start --resources``) each process of a role asks for, to
    pin roles to the nodes that offer them; CPUs and GPUs come from the placement."""

    controller: dict[str, float] = {}
    generation: dict[str, float] = {}
    # Each trainer rank (its placement-group bundle holds the PPO critic's rank beside it).
    trainer: dict[str, float] = {}


class ClusterConfig(Strict):
    # None: start an embedded local Ray instance; otherwise the address of an existing cluster.
    address: str | None = None
    num_cpus: int | None = Field(None, ge=1)
    num_gpus: int | None = Field(None, ge=0)
    namespace: str = "tandemrl"
    actor_resources: ActorResourcesConfig = ActorResourcesConfig()
    # Whether the run's actors report their calls to Ray's task-event store in the GCS (what
    # `ray list tasks` and the dashboard's task view read). Each call is a record there, kept
    # until the store's cap (docs/long_runs.md); off, a long run's GCS stays flat.
    ray_task_events: bool = False


class WandbConfig(Strict):
    """Weights & Biases: the per-step metrics of metrics.jsonl, plus the (redacted) config."""

    enabled: bool = False
    project: str = "tandemrl"
    # Run name; None lets W&B pick one.
    name: str | None = None
    entity: str | None = None
    tags: list[str] = []
    # "online", "offline" (files under <log_dir>/wandb, `wandb sync` later) or "disabled";
    # None: the WANDB_MODE environment variable, else online. The API key comes from the
    # environment (WANDB_API_KEY) or `wandb login`, never from this file.
    mode: Literal["online", "offline", "disabled"] | None = None


class MlflowConfig(Strict):
    """MLflow: the per-step metrics of metrics.jsonl, plus the (redacted) config as params."""

    enabled: bool = False
    experiment_name: str = "tandemrl"
    run_name: str | None = None
    # None: a local store, sqlite:///<log_dir>/mlflow.db. A server URI works too; its
    # credentials belong in MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN, not in the URI.
    tracking_uri: str | None = None


class LoggerConfig(Strict):
    log_dir: str = "runs/latest"
    jsonl: bool = True
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # Every N steps, a few completions with their rewards go to samples.jsonl and TensorBoard
    # (0: never).
    sample_log_period: int = Field(10, ge=0)
    # At the end of every run the trained policy is written as a transformers model folder
    # (weights, config, generation config, tokenizer) to final_model_dir, relative to log_dir
    # unless absolute.
    save_final_model: bool = True
    final_model_dir: str = "final_model"
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()


class MasterConfig(Strict):
    policy: PolicyConfig = PolicyConfig()
    grpo: GRPOConfig | None = None
    ppo: PPOConfig | None = None
    on_policy_distillation: OnPolicyDistillationConfig | None = None
    value: ValueConfig | None = None
    value_loss_fn: ValueLossConfig | None = None
    loss_fn: LossConfig = LossConfig()
    async_rl: AsyncRLConfig = AsyncRLConfig()
    data_plane: DataPlaneConfig = DataPlaneConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    rollout_checkpointing: RolloutCheckpointingConfig = RolloutCheckpointingConfig()
    token_capture: TokenCaptureConfig = TokenCaptureConfig()
    rollout_recovery: RolloutRecoveryConfig = RolloutRecoveryConfig()
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    cluster: ClusterConfig = ClusterConfig()
    logger: LoggerConfig = LoggerConfig()

    @model_validator(mode="before")
    @classmethod
    def _derive_defaults(cls, data: Any) -> Any:
        """Fill the defaults that depend on other keys, so they agree with each other.

        Left out (or null), they follow the algorithm block and the sampler:
        ``min_groups_for_streaming_train`` = num_prompts_per_step (whole-step batches);
        ``max_buffered_rollouts`` and ``max_inflight_prompts`` = num_prompts_per_step x
        (lookahead + 1), never below the sampler's required capacity (a custom sampler:
        2 x and 1 x num_prompts_per_step; windowed with ``over_sampling_ratio``: its dispatch
        cap, so that the cap is what limits dispatch); ``loss_fn.use_importance_sampling_correction`` =
        whether the sampler admits off-policy data. A minimal config is then valid, and means
        the same whichever of these it spells out.
        """
        if not isinstance(data, dict):
            return data
        data = dict(data)
        n = _num_prompts_per_step(data)
        sampler = _sampler_of(data.get("async_rl"))
        if n is None or sampler is None:
            return data  # the invalid block is reported by validation
        if sampler.name == "custom":
            buffered, inflight, off_policy = 2 * n, n, True
        else:
            # The sampler owns its rules (capacity, lookahead, off-policy data): ask it.
            # Imported here: the samplers package imports this module.
            from tandemrl.samplers import builtin_sampler

            built = builtin_sampler(sampler, groups_per_step=n)
            widest = getattr(built, "widest_lookahead_versions", None)
            if widest is None:  # windowed: ungated, its window is max_staleness_versions
                widest = sampler.max_staleness_versions
            window = n * (widest + 1)
            limit = getattr(built, "dispatch_limit", lambda: None)()
            if limit is not None:  # windowed with over_sampling_ratio: room for the cap
                window = limit
            buffered = max(window, built.required_buffer_capacity(n))
            inflight = window
            off_policy = built.off_policy_reason() is not None
        _fill(data, "async_rl", "min_groups_for_streaming_train", n)
        _fill(data, "async_rl", "max_buffered_rollouts", buffered)
        _fill(data, "async_rl", "max_inflight_prompts", inflight)
        _fill(data, "loss_fn", "use_importance_sampling_correction", off_policy)
        return data

    @property
    def algorithm(self) -> GRPOConfig | PPOConfig | OnPolicyDistillationConfig:
        """The one algorithm block present (validation guarantees exactly one)."""
        return self._algorithm_block()[1]

    @property
    def algorithm_key(self) -> str:
        """The name of the algorithm block present: its dotpath prefix in messages."""
        return self._algorithm_block()[0]

    def _algorithm_block(self) -> tuple[str, GRPOConfig | PPOConfig | OnPolicyDistillationConfig]:
        blocks: tuple[tuple[str, GRPOConfig | PPOConfig | OnPolicyDistillationConfig | None], ...]
        blocks = (
            ("ppo", self.ppo),
            ("on_policy_distillation", self.on_policy_distillation),
            ("grpo", self.grpo),
        )
        for key, block in blocks:
            if block is not None:
                return key, block
        raise ValueError("config has none of grpo:, ppo:, on_policy_distillation:")

    @property
    def is_ppo(self) -> bool:
        return self.ppo is not None

    @property
    def is_distillation(self) -> bool:
        return self.on_policy_distillation is not None

    @property
    def validates(self) -> bool:
        """Whether any validation pass is scheduled (val_period, val_at_start, val_at_end)."""
        try:
            algo = self.algorithm
        except ValueError:  # no algorithm block: validation reports that
            return False
        return algo.val_period > 0 or algo.val_at_start or algo.val_at_end

    @property
    def val_inflight_share(self) -> int:
        """Validation prompts in flight at once: val_batch_size, by default a quarter of
        async_rl.max_inflight_prompts (at least 1)."""
        chosen = self.algorithm.val_batch_size
        return chosen if chosen is not None else max(1, self.async_rl.max_inflight_prompts // 4)


_SAMPLER_ADAPTER: TypeAdapter[Any] = TypeAdapter(SamplerConfig)


def _block(data: dict[str, Any], key: str) -> dict[str, Any] | None:
    """A block of raw master-config input as a dict of what was set (None: not a block)."""
    value = data.get(key)
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True, by_alias=True)
    return value if isinstance(value, dict) else None


def _num_prompts_per_step(data: dict[str, Any]) -> int | None:
    for key, model in (
        ("ppo", PPOConfig),
        ("on_policy_distillation", OnPolicyDistillationConfig),
        ("grpo", GRPOConfig),
    ):
        if data.get(key) is None:
            continue
        block = _block(data, key)
        if block is None:
            return None
        value = block.get("num_prompts_per_step")
        if value is None:
            return model.model_fields["num_prompts_per_step"].default
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return GRPOConfig.model_fields["num_prompts_per_step"].default


def _sampler_of(async_rl: Any) -> Any:
    if async_rl is None:
        return AsyncRLConfig().sampler
    block = async_rl.model_dump(exclude_unset=True) if isinstance(async_rl, BaseModel) else async_rl
    if not isinstance(block, dict):
        return None
    raw = block.get("sampler")
    if raw is None:
        return AsyncRLConfig().sampler
    try:
        return _SAMPLER_ADAPTER.validate_python(raw)
    except ValueError:
        return None


def _fill(data: dict[str, Any], block_key: str, key: str, value: Any) -> None:
    """Set ``data[block_key][key]`` to ``value`` when it is left out or null."""
    block = data.get(block_key)
    if isinstance(block, BaseModel):
        if key in block.model_fields_set and getattr(block, key) is not None:
            return
        block = block.model_dump(exclude_unset=True, by_alias=True)
    elif block is None:
        block = {}
    elif not isinstance(block, dict):
        return
    if block.get(key) is None:
        data[block_key] = {**block, key: value}
