"""Read a config written for NeMo-RL: rename what TandemRL calls otherwise, drop what is harmless,
refuse what it cannot honour — one line per blocker, never a silent drop of a key that
changes training.

``translate_nemo_rl(tree)`` works on the interpolated plain tree (so every ``${...}`` of the
original has already seen the NeMo-RL keys it points at) and returns:

- ``tree``: the TandemRL tree;
- ``notices``: one line per key carried over under another name or shape ("renamed"), or
  accepted although TandemRL does something slightly different ("ignored", "differs");
- ``refusals``: one "not supported by TandemRL: <what>; <what to do>" line per subtree that
  changes training and that TandemRL cannot honour (the Megatron trainer, sharded NeMo-Gym, tensor
  parallelism, LoRA, a KL penalty to a reference model, ...). The subtree is removed, so
  none of its keys shows up again as "unknown key";
- ``dropped``: every key that was not carried over and why (``tandemrl port`` lists them).

Harmless means: the value is the one that switches the feature off (``enabled: false``,
``null``, ``0``, ``1`` for a parallel size), or the key only tunes speed, memory, ports or
logging of a part TandemRL does differently. Keys that are TandemRL's own pass through
untouched: each rule looks at the shape NeMo-RL writes (``policy.scheduler`` as a list,
``logger.tensorboard`` as a mapping, ``policy.optimizer.kwargs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_MISSING = object()
Predicate = Callable[[Any], bool]


def _null(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    return value is None or value is False


def _zero(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and value == 0)


def _one(value: Any) -> bool:
    return value is None or value == 1


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _any(value: Any) -> bool:
    return True


def _disabled(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and not value.get("enabled", False))


def _equals(expected: Any) -> Predicate:
    return lambda value: value is None or value == expected


@dataclass
class Dropped:
    """A key that was not carried over into the TandemRL config."""

    path: str
    reason: str
    refused: bool = False


@dataclass
class Translation:
    tree: dict[str, Any]
    notices: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    refused_paths: list[str] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)


def translate_nemo_rl(tree: dict[str, Any]) -> Translation:
    """The TandemRL view of ``tree`` (modified in place and returned in the result)."""
    tx = _Translator(Translation(tree=tree))
    for block in ("grpo", "ppo"):
        if isinstance(tree.get(block), dict):
            _algorithm(tx, block)
    _loss(tx)
    _policy(tx)
    _generation(tx)
    _async_rl(tx)
    _data(tx)
    _env(tx)
    _logger(tx)
    _checkpoints(tx)
    _cluster_and_data_plane(tx)
    _top_level(tx)
    return tx.result


class _Translator:
    def __init__(self, result: Translation) -> None:
        self.result = result
        self.tree = result.tree

    # ------------------------------------------------------------------ tree access

    def get(self, path: str) -> Any:
        node: Any = self.tree
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                return _MISSING
            node = node[key]
        return node

    def pop(self, path: str) -> Any:
        *parents, last = path.split(".")
        node = self.get(".".join(parents)) if parents else self.tree
        if not isinstance(node, dict) or last not in node:
            return _MISSING
        return node.pop(last)

    def set(self, path: str, value: Any) -> None:
        *parents, last = path.split(".")
        node = self.tree
        for key in parents:
            child = node.get(key)
            if not isinstance(child, dict):
                child = {}
                node[key] = child
            node = child
        node[last] = value

    def has(self, path: str) -> bool:
        return self.get(path) is not _MISSING

    # ------------------------------------------------------------------ outcomes

    def notice(self, message: str) -> None:
        self.result.notices.append(message)

    def drop(self, path: str, reason: str) -> None:
        self.result.dropped.append(Dropped(path, reason))

    def refuse(self, path: str, what: str, todo: str, *, also: tuple[str, ...] = ()) -> None:
        self.result.refusals.append(f"{path}: not supported by TandemRL: {what}; {todo}")
        self.result.refused_paths.extend([path, *also])
        self.result.dropped.append(Dropped(path, f"not supported: {what}", refused=True))

    # ------------------------------------------------------------------ rules

    def inert(
        self, path: str, harmless: Predicate, what: str, todo: str = "", *, reason: str = ""
    ) -> None:
        """Drop ``path`` when its value is harmless, refuse it (one line) otherwise."""
        value = self.pop(path)
        if value is _MISSING:
            return
        if harmless(value):
            self.drop(path, reason or f"{what} is off")
        else:
            self.refuse(path, what, todo or f"remove {path}")

    def ignore(self, path: str, reason: str, *, tell: bool = False) -> None:
        """Drop ``path`` whatever it holds (speed, memory, ports, logging of other parts)."""
        value = self.pop(path)
        if value is _MISSING:
            return
        self.drop(path, reason)
        if tell:
            self.notice(f"{path}: ignored — {reason}")

    def rename(
        self, old: str, new: str, convert: Callable[[Any], Any] | None = None, note: str = ""
    ) -> None:
        """Carry ``old`` over as ``new`` (refused when both are written and disagree)."""
        value = self.pop(old)
        if value is _MISSING:
            return
        value = convert(value) if convert is not None else value
        existing = self.get(new)
        if existing is not _MISSING and existing != value:
            self.refuse(
                old,
                f"both {old} (NeMo-RL's name) and {new} are set, to different values",
                f"keep only {new}",
            )
            return
        self.set(new, value)
        self.notice(f"{old}: renamed to {new}{f' ({note})' if note else ''}")


# --------------------------------------------------------------------------- blocks


def _algorithm(tx: _Translator, block: str) -> None:
    for key in ("reward_shaping", "reward_scaling"):
        value = tx.get(f"{block}.{key}")
        if isinstance(value, dict) and not value.get("enabled", False):
            tx.pop(f"{block}.{key}")
            tx.drop(f"{block}.{key}", f"{key} is disabled (enabled: false)")
    legacy = "async_grpo" if block == "grpo" else "async_ppo"
    value = tx.get(f"{block}.{legacy}")
    if isinstance(value, dict) and not value.get("enabled", False):
        tx.pop(f"{block}.{legacy}")
        tx.drop(f"{block}.{legacy}", "the legacy async block is disabled (enabled: false)")
    if tx.get("env.should_use_nemo_gym") is True:
        # Gym's agent plays the turns; TandemRL caps the calls of one episode.
        tx.rename(f"{block}.max_rollout_turns", "env.agent.max_turns")
    else:
        tx.inert(
            f"{block}.max_rollout_turns",
            _one,
            "multi-turn rollouts",
            "TandemRL's environments score one completion per prompt; set it to 1 (or "
            "write an agent: env.name: agent, docs/agents.md)",
            reason="one turn per rollout is what TandemRL does",
        )
    tx.rename(f"{block}.val_num_generations_per_prompt", f"{block}.val_num_generations")
    if not _validation_on(tx):
        for key in ("max_val_samples", "val_batch_size", "val_num_generations"):
            tx.ignore(f"{block}.{key}", _VALIDATION_OFF)
    tx.ignore(f"{block}.val_start_at", "validation passes follow val_period from the start")
    for key in ("stop_at_validation_metric", "stop_at_validation_threshold"):
        tx.inert(
            f"{block}.{key}",
            _null,
            "stopping the run at a validation metric",
            f"set {block}.{key}: null (bound the run with {block}.max_num_steps)",
        )
    tx.ignore(f"{block}.num_val_samples_to_print", _NO_VAL_SAMPLES)
    for key in ("advantage_clip_low", "advantage_clip_high"):
        tx.inert(f"{block}.{key}", _null, "advantage clipping", f"set {block}.{key}: null")
    tx.inert(
        f"{block}.seq_logprob_error_threshold",
        _null,
        "dropping sequences by logprob error",
        f"set {block}.seq_logprob_error_threshold: null",
    )
    for key in ("invalid_tool_call_advantage", "malformed_thinking_advantage"):
        tx.inert(
            f"{block}.{key}",
            _null,
            "NeMo-Gym message-level advantage penalties",
            f"set {block}.{key}: null",
        )
    tx.inert(
        f"{block}.reward_shaping.alp_coef",
        _null,
        "the adaptive length penalty (reward_shaping.alp_coef)",
        f"use the overlong penalty or stop_properly_penalty_coef, and set "
        f"{block}.reward_shaping.alp_coef: null",
    )
    tx.ignore(f"{block}.calculate_advantages_on_gpu", "where advantages are computed")
    tx.inert(
        f"{block}.batch_multiplier",
        _one,
        "over-generation for dynamic sampling",
        f"set {block}.batch_multiplier: 1",
    )
    tx.ignore(
        f"{block}.skip_reference_policy_logprobs_calculation",
        "TandemRL computes reference logprobs exactly when loss_fn.reference_policy_kl_penalty > 0",
    )
    estimator = tx.get(f"{block}.adv_estimator")
    if block == "grpo" and isinstance(estimator, dict):
        tx.pop(f"{block}.adv_estimator")
        if estimator.get("name", "grpo") != "grpo":
            tx.refuse(
                f"{block}.adv_estimator",
                f"the {estimator.get('name')!r} advantage estimator",
                "TandemRL's GRPO uses group-normalized advantages; set adv_estimator.name: grpo",
            )
            return
        for key in ("normalize_rewards", "use_leave_one_out_baseline"):
            if key in estimator and estimator[key] != tx.get(f"{block}.{key}"):
                if tx.has(f"{block}.{key}"):
                    tx.refuse(
                        f"{block}.adv_estimator.{key}",
                        f"adv_estimator.{key} different from {block}.{key}",
                        f"set {block}.{key} to the value you want and drop the estimator's",
                    )
                    continue
                tx.set(f"{block}.{key}", estimator[key])
        tx.drop(f"{block}.adv_estimator", "the GRPO estimator's settings are grpo.* keys here")


def _loss(tx: _Translator) -> None:
    # reference_policy_kl_penalty, reference_policy_kl_type, kl_input/output_clamp_value and
    # ratio_clip_c are TandemRL keys of the same name and meaning: they pass through.
    tx.inert(
        "loss_fn.use_on_policy_kl_approximation",
        _off,
        "the on-policy KL approximation (TandemRL weights the reference KL by the "
        "importance weights of the off-policy correction instead)",
        "set loss_fn.use_on_policy_kl_approximation: false",
    )
    tx.inert(
        "loss_fn.use_kl_in_reward",
        _off,
        "the KL penalty folded into the reward (TandemRL adds it to the loss)",
        "set loss_fn.use_kl_in_reward: false",
    )
    tx.inert(
        "loss_fn.sequence_level_importance_ratios",
        _off,
        "sequence-level importance ratios (GSPO)",
        "set loss_fn.sequence_level_importance_ratios: false",
    )
    tx.inert("loss_fn.use_cispo", _off, "the CISPO loss", "set loss_fn.use_cispo: false")
    tx.inert(
        "loss_fn.disable_ppo_ratio",
        _off,
        "the REINFORCE surrogate without a PPO ratio",
        "set loss_fn.disable_ppo_ratio: false",
    )
    tx.inert(
        "loss_fn.positive_example_nll_weight",
        _zero,
        "the VAPO positive-example NLL term",
        "set loss_fn.positive_example_nll_weight: 0",
    )
    tx.rename(
        "loss_fn.force_on_policy_ratio",
        "loss_fn.reuse_training_logprobs",
        note="the PPO ratio is exactly 1: prev_logprobs come from the training forward",
    )
    _truncated_importance_sampling(tx)


def _truncated_importance_sampling(tx: _Translator) -> None:
    kind = tx.pop("loss_fn.truncated_importance_sampling_type")
    ratio = tx.pop("loss_fn.truncated_importance_sampling_ratio")
    ratio_min = tx.pop("loss_fn.truncated_importance_sampling_ratio_min")
    if kind is _MISSING and ratio is _MISSING and ratio_min is _MISSING:
        return
    where = "loss_fn.truncated_importance_sampling_type"
    kind = None if kind is _MISSING else kind
    ratio = None if ratio is _MISSING else ratio
    ratio_min = None if ratio_min is _MISSING else ratio_min
    target = "loss_fn.importance_sampling"
    if kind is None:
        tx.set(f"{target}.mode", "untruncated")
        tx.notice(f"{where}: null carried over as {target}.mode: untruncated")
    elif kind == "tis" and _zero(ratio_min) and ratio is not None:
        tx.set(f"{target}.mode", "tis")
        tx.set(f"{target}.truncation", ratio)
        tx.notice(f"{where}: tis carried over as {target}: {{mode: tis, truncation: {ratio}}}")
    elif kind == "icepop" and ratio is not None and ratio_min is not None:
        tx.set(f"{target}.mode", "icepop")
        tx.set(f"{target}.low", ratio_min)
        tx.set(f"{target}.high", ratio)
        tx.notice(
            f"{where}: icepop carried over as {target}: {{mode: icepop, low: {ratio_min}, "
            f"high: {ratio}}}"
        )
    else:
        tx.refuse(
            where,
            f"truncated importance sampling {kind!r} with ratio {ratio} and ratio_min "
            f"{ratio_min} (TandemRL's tis truncates from above only; its seq-mask-tis also "
            "truncates every token)",
            f"set {target}.mode (tis, icepop, seq-mask-tis, untruncated) and its bounds",
        )


def _policy(tx: _Translator) -> None:
    megatron = tx.get("policy.megatron_cfg")
    if isinstance(megatron, dict):
        if megatron.get("enabled"):
            tx.pop("policy.megatron_cfg")
            tx.refuse(
                "policy.megatron_cfg",
                "the Megatron trainer",
                "train with the PyTorch trainer: set policy.megatron_cfg.enabled: false and "
                "policy.dtensor_cfg.enabled: true",
                also=("policy.dtensor_cfg.enabled",),
            )
        elif set(megatron) - {"enabled"}:
            tx.set("policy.megatron_cfg", {"enabled": False})
            tx.drop("policy.megatron_cfg.*", "the Megatron trainer is disabled")
    dtensor = "policy.dtensor_cfg"
    tx.ignore(f"{dtensor}._v2", "TandemRL has one PyTorch trainer")
    tx.ignore(f"{dtensor}.clear_cache_every_n_steps", "memory tuning of NeMo-RL's trainer")
    for key in ("tensor_parallel_size", "context_parallel_size"):
        tx.inert(
            f"{dtensor}.{key}",
            _one,
            f"{key.replace('_', ' ')} > 1",
            f"set {dtensor}.{key}: 1 (TandemRL shards with FSDP2 data parallelism only)",
        )
    tx.inert(
        f"{dtensor}.sequence_parallel",
        _off,
        "sequence parallelism",
        f"set {dtensor}.sequence_parallel: false",
    )
    tx.inert(
        f"{dtensor}.cpu_offload",
        _off,
        "CPU offload of the trained parameters",
        f"set {dtensor}.cpu_offload: false",
    )
    tx.inert(
        f"{dtensor}.custom_parallel_plan",
        _null,
        "a custom parallel plan",
        f"set {dtensor}.custom_parallel_plan: null",
    )
    tx.inert(
        f"{dtensor}.automodel_kwargs",
        _empty,
        "NeMo AutoModel loading options",
        f"remove {dtensor}.automodel_kwargs",
    )
    tx.inert(
        f"{dtensor}.lora_cfg",
        _disabled,
        "LoRA adapters",
        f"set {dtensor}.lora_cfg.enabled: false (TandemRL trains all weights)",
    )
    tx.inert(
        f"{dtensor}.env_vars",
        _empty,
        "per-worker environment variables",
        f"remove {dtensor}.env_vars",
    )
    tx.inert(
        "policy.draft",
        _disabled,
        "a speculative-decoding draft model",
        "set policy.draft.enabled: false",
    )
    tx.inert(
        "policy.hf_config_overrides",
        _empty,
        "overrides of the model's config.json",
        "edit the model folder's config.json instead",
    )
    tx.inert(
        "policy.tokenizer.chat_template_kwargs",
        _null,
        "chat template arguments",
        "set policy.tokenizer.chat_template_kwargs: null",
    )
    tx.ignore("policy.tokenizer.use_fastokens", "tokenizer implementation choice")
    speed = "micro-batches of the logprob pass follow train_micro_batch_size / tokens"
    tx.ignore("policy.logprob_batch_size", speed, tell=True)
    tx.ignore("policy.logprob_chunk_size", "memory tuning of the logprob pass")
    tx.ignore("policy.generation_batch_size", "only used by NeMo-RL's HF generation backend")
    tx.ignore(
        "policy.make_sequence_length_divisible_by",
        "padding for tensor/sequence parallelism, which TandemRL does not use",
    )
    _batching(tx)
    _optimizer(tx)
    _scheduler(tx)


def _batching(tx: _Translator) -> None:
    packing = tx.get("policy.sequence_packing")
    dynamic = tx.get("policy.dynamic_batching")
    tokens: Any = _MISSING
    if isinstance(dynamic, dict):
        tx.pop("policy.dynamic_batching")
        if dynamic.get("enabled"):
            tokens = dynamic.get("train_mb_tokens", _MISSING)
        tx.drop("policy.dynamic_batching", "carried over as policy.train_micro_batch_tokens")
    if isinstance(packing, dict):
        tx.pop("policy.sequence_packing")
        enabled = bool(packing.get("enabled"))
        tx.set("policy.sequence_packing", "on" if enabled else "off")
        if enabled:
            tokens = packing.get("train_mb_tokens", tokens)
        tx.notice(
            f"policy.sequence_packing.enabled: carried over as policy.sequence_packing: "
            f"{'on' if enabled else 'off'}"
        )
    if tokens not in (_MISSING, None) and not tx.has("policy.train_micro_batch_tokens"):
        tx.set("policy.train_micro_batch_tokens", tokens)
        tx.notice(f"train_mb_tokens: carried over as policy.train_micro_batch_tokens: {tokens}")


def _optimizer(tx: _Translator) -> None:
    for key, example in (
        ("optimizer", "{name: torch.optim.AdamW, kwargs: {lr: 5.0e-6, weight_decay: 0.01}}"),
        ("scheduler", "{name: linear_warmup, warmup_steps: N, start_factor: F} or constant"),
    ):
        if tx.get(f"policy.{key}") is None:
            tx.pop(f"policy.{key}")
            tx.refuse(
                f"policy.{key}",
                f"policy.{key}: null (the Megatron trainer reads megatron_cfg.{key} instead)",
                f"give the PyTorch trainer its {key}: policy.{key}: {example}",
            )
    optimizer = tx.get("policy.optimizer")
    if not isinstance(optimizer, dict) or "kwargs" not in optimizer:
        name = optimizer.get("name") if isinstance(optimizer, dict) else None
        if name in ("torch.optim.AdamW", "AdamW"):
            optimizer["name"] = "adamw"
        return
    name = optimizer.get("name", "torch.optim.AdamW")
    kwargs = dict(optimizer.get("kwargs") or {})
    for key in ("foreach", "fused"):
        kwargs.pop(key, None)  # implementation choices; TandemRL picks fused where it can
    weight_decay = kwargs.get("weight_decay", 0.0)
    if name in ("torch.optim.Adam", "Adam") and weight_decay == 0:
        name = "torch.optim.AdamW"  # identical updates without weight decay
    if name not in ("torch.optim.AdamW", "AdamW", "adamw"):
        tx.pop("policy.optimizer")
        tx.refuse("policy.optimizer.name", f"the optimizer {name!r}", "use torch.optim.AdamW")
        return
    unknown = sorted(set(kwargs) - {"lr", "betas", "eps", "weight_decay"})
    if unknown:
        tx.pop("policy.optimizer")
        tx.refuse(
            "policy.optimizer.kwargs",
            f"AdamW arguments {', '.join(unknown)}",
            "keep lr, betas, eps and weight_decay only",
        )
        return
    converted = {"name": "adamw", **kwargs}
    tx.set("policy.optimizer", converted)
    tx.notice(
        "policy.optimizer: {name: torch.optim.AdamW, kwargs: ...} carried over as "
        f"policy.optimizer: {converted}"
    )


def _scheduler(tx: _Translator) -> None:
    scheduler = tx.get("policy.scheduler")
    if not isinstance(scheduler, list | dict) or (
        isinstance(scheduler, dict) and "kwargs" not in scheduler
    ):
        return
    tx.pop("policy.scheduler")
    steps = scheduler if isinstance(scheduler, list) else [scheduler]
    schedulers = [s for s in steps if isinstance(s, dict) and "name" in s]
    names = [str(s["name"]).rsplit(".", 1)[-1] for s in schedulers]
    kwargs = [s.get("kwargs") or {} for s in schedulers]
    constant = [k.get("factor", 1.0) == 1.0 for k in kwargs]
    converted: dict[str, Any] | None = None
    if names == ["ConstantLR"] and constant[0]:
        converted = {"name": "constant"}
    elif (
        names
        and names[0] == "LinearLR"
        and all(
            name == "ConstantLR" and ok for name, ok in zip(names[1:], constant[1:], strict=True)
        )
    ):
        linear = kwargs[0]
        if linear.get("end_factor", 1.0) == 1.0:
            converted = {
                "name": "linear_warmup",
                "warmup_steps": int(linear.get("total_iters", 5)),
                "start_factor": float(linear.get("start_factor", 1.0 / 3.0)),
            }
    if converted is None:
        tx.refuse(
            "policy.scheduler",
            f"the learning-rate schedule {' then '.join(names) or scheduler!r}",
            "TandemRL has constant and linear_warmup (LinearLR up to the full rate, then "
            "constant); set policy.scheduler: {name: linear_warmup, warmup_steps: N, "
            "start_factor: F}",
        )
        return
    tx.set("policy.scheduler", converted)
    tx.notice(f"policy.scheduler: {' then '.join(names)} carried over as {converted}")


def _generation(tx: _Translator) -> None:
    generation = "policy.generation"
    top_k = tx.get(f"{generation}.top_k")
    if top_k is not _MISSING:
        tx.inert(
            f"{generation}.top_k",
            lambda v: v is None or (isinstance(v, int) and v <= 0),
            "top-k sampling",
            f"set {generation}.top_k: null (top_p is supported)",
            reason="top-k is off (null)",
        )
    if not _validation_on(tx):
        for key in ("val_temperature", "val_top_p", "val_top_k"):
            tx.ignore(f"{generation}.{key}", _VALIDATION_OFF)
    for key in ("port_range_low", "port_range_high"):
        tx.ignore(f"{generation}.{key}", "TandemRL's engines serve no HTTP ports")
    tx.inert(
        f"{generation}.refit_transport",
        _null,
        "NeMo-RL's refit transports",
        f"set {generation}.weight_sync (auto, object_store, cuda_ipc, nccl) instead",
    )
    tx.ignore(f"{generation}.refit_cfg", "settings of NeMo-RL's refit transports")
    tx.ignore(f"{generation}.real_quant_export_cpu_offload", "quantized export is not used")
    tx.ignore(f"{generation}.mcore_generation_config", "Megatron generation is not available")
    for key in ("gpus_per_node", "num_nodes"):
        path = f"{generation}.colocated.resources.{key}"
        if tx.get(path) is None:
            tx.pop(path)
            tx.drop(path, "null: TandemRL's default applies")
    vllm = f"{generation}.vllm_cfg"
    precision = tx.get("policy.precision")
    tx.inert(
        f"{vllm}.precision",
        _equals(precision),
        "a vLLM precision unlike policy.precision",
        f"remove {vllm}.precision",
    )
    tx.inert(
        f"{vllm}.kv_cache_dtype",
        _equals("auto"),
        "a vLLM KV-cache dtype",
        f"set {vllm}.kv_cache_dtype: auto",
    )
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
        tx.inert(f"{vllm}.{key}", _one, f"vLLM {key.replace('_', ' ')} > 1", f"set {vllm}.{key}: 1")
    for key in ("num_last_layers_in_bf16", "num_first_layers_in_bf16"):
        tx.inert(f"{vllm}.{key}", _zero, "mixed-precision vLLM layers", f"set {vllm}.{key}: 0")
    for key in (
        "logprobs_mode",
        "use_tqdm",
        "use_deep_gemm",
        "enable_vllm_metrics_logger",
        "vllm_metrics_logger_interval",
        "http_refit_api_key_env_var",
        "enable_prefix_caching",
        "reset_encoder_cache_after_weight_update",
        "http_refit_server_port",
        "zmq_refit_server_port",
    ):
        tx.ignore(f"{vllm}.{key}", "speed, logging or ports of NeMo-RL's vLLM workers")
    # NeMo-Gym's model server calls an OpenAI server; TandemRL's is the policy endpoint.
    tx.rename(f"{vllm}.expose_http_server", "policy.generation.http_server.enabled")
    tx.ignore(f"{vllm}.skip_tokenizer_init", "tokenizer loading of NeMo-RL's vLLM workers")
    tx.ignore(f"{vllm}.http_server_serving_chat_kwargs", "NeMo-RL's vLLM HTTP server")
    tx.inert(
        f"{generation}.vllm_kwargs",
        _empty,
        "extra vLLM engine arguments",
        f"remove {generation}.vllm_kwargs",
    )


def _async_rl(tx: _Translator) -> None:
    failure = "async_rl.rollout_failure"
    tx.rename(
        f"{failure}.max_infra_attempts_per_prompt",
        f"{failure}.max_infra_retries",
        _attempts_to_retries,
        note="attempts - 1",
    )
    tx.rename(
        f"{failure}.max_data_attempts_per_prompt",
        f"{failure}.max_data_retries",
        _attempts_to_retries,
        note="attempts - 1",
    )
    tx.rename(f"{failure}.backoff_base_s", f"{failure}.backoff_initial_s")
    tx.rename(f"{failure}.max_backoff_s", f"{failure}.backoff_max_s")
    tx.rename(f"{failure}.replacement_reserve_prompts", f"{failure}.replacement_reserve_size")
    tx.inert(
        f"{failure}.max_replacement_attempts",
        _one,
        "more than one replacement prompt per lost group",
        f"set {failure}.max_replacement_attempts: 1",
    )
    tx.rename(f"{failure}.native.generation_timeout_s", f"{failure}.generation_timeout_s")
    tx.inert(
        f"{failure}.native.env_timeout_s",
        _null,
        "a deadline on one environment step",
        f"use {failure}.rollout_timeout_s (generation and scoring of one request)",
    )
    _drop_if_empty(tx, f"{failure}.native")
    nemo_gym = tx.pop(f"{failure}.nemo_gym")
    if isinstance(nemo_gym, dict):
        timeout = nemo_gym.pop("rollout_timeout_s", None)
        if timeout is not None:
            tx.set("env.nemo_gym.run_timeout_s", timeout)
            tx.notice(
                f"{failure}.nemo_gym.rollout_timeout_s: renamed to env.nemo_gym.run_timeout_s "
                "(the deadline of one Gym /run)"
            )
        for key in nemo_gym:
            tx.drop(f"{failure}.nemo_gym.{key}", "NeMo-RL's own retry knobs of Gym rollouts")
    elif nemo_gym is not _MISSING:
        tx.drop(f"{failure}.nemo_gym", "settings of NeMo-Gym rollouts, which are not used")
    watchdog = "async_rl.stall_watchdog"
    tx.rename(f"{watchdog}.stall_timeout_s", f"{watchdog}.timeout_s")
    tx.rename(f"{watchdog}.stall_action", f"{watchdog}.action")
    tx.ignore(f"{watchdog}.interval_s", "TandemRL's watchdog checks every few seconds")
    tx.ignore(
        f"{watchdog}.gym_subprocess_check",
        "TandemRL probes the Gym servers itself (the stall report names one that stopped)",
    )
    tx.inert(
        "async_rl.generation_fleet_health",
        _disabled,
        "per-shard health probes of the generation fleet",
        "set async_rl.generation_fleet_health.enabled: false (a generation worker that "
        "dies is dropped and the run goes on with the others)",
    )
    tx.inert(
        "async_rl.generation_router",
        _disabled,
        "the NeMo-Gym HTTP router",
        "set async_rl.generation_router.enabled: false",
    )
    tx.ignore("async_rl.diagnostics", "per-rollout debug prints")
    for old, new in (("watchdog", "stall_watchdog"),):
        tx.rename(f"async_rl.{old}", f"async_rl.{new}")


_VALIDATION_OFF = "validation is off (no val_period, val_at_start or val_at_end)"
_NO_VAL_SAMPLES = (
    "TandemRL prints no validation samples; every pass's metrics go to validation.jsonl"
)
# NeMo-RL's names of a checkpoint metric -> the validation metric TandemRL reports for it (its
# math environment's accuracy is the mean of a 0/1 reward).
_NEMO_RL_METRICS = {
    "val_reward": "val/reward_mean",
    "val:reward": "val/reward_mean",
    "val_accuracy": "val/reward_mean",
    "val:accuracy": "val/reward_mean",
    "val_avg_length": "val/mean_length",
    "val:avg_length": "val/mean_length",
}


def _validation_on(tx: _Translator) -> bool:
    """Whether the algorithm block schedules any validation pass."""
    for block in ("grpo", "ppo"):
        algo = tx.get(block)
        if isinstance(algo, dict):
            period = algo.get("val_period")
            if (isinstance(period, int) and period > 0) or algo.get("val_at_start") is True:
                return True
            if algo.get("val_at_end") is True:
                return True
    return False


def _validation_data(tx: _Translator) -> None:
    """NeMo-RL's ``data.validation`` block (``data_path`` and its keys) as TandemRL's
    ``data.validation`` source; a TandemRL string passes through."""
    value = tx.get("data.validation")
    if value is _MISSING or isinstance(value, str):
        return
    tx.pop("data.validation")
    if value is None:
        tx.drop("data.validation", "null: no validation data")
        return
    if not _validation_on(tx):
        tx.drop("data.validation", _VALIDATION_OFF)
        return
    block = value if isinstance(value, dict) else {}
    path = block.get("data_path")
    if path is None:
        tx.refuse(
            "data.validation",
            f"NeMo-RL's validation dataset {block.get('dataset_name')!r} (hub datasets and "
            "processors)",
            "convert it to a local JSONL file and set data.validation: PATH",
        )
        return
    train = tx.get("data.train")
    train = train if isinstance(train, dict) else {}
    for key, default in (("input_key", "input"), ("output_key", "output")):
        mine, theirs = block.get(key, default), train.get(key, default)
        if mine != theirs:
            tx.refuse(
                f"data.validation.{key}",
                f"a validation field mapping ({key}: {mine!r}) unlike the training data's "
                f"({theirs!r})",
                "TandemRL reads data.validation with the data.*_key mapping of data.dataset; "
                "rename the fields of one of the files",
            )
            return
    tx.set("data.validation", path)
    tx.notice(f"data.validation.data_path: carried over as data.validation: {path}")


def _checkpoint_metric(tx: _Translator) -> None:
    name = tx.get("checkpointing.metric_name")
    if name is _MISSING or name is None or (isinstance(name, str) and name.startswith("val/")):
        return
    tx.pop("checkpointing.metric_name")
    if not _validation_on(tx):
        tx.ignore("checkpointing.higher_is_better", _VALIDATION_OFF)
        tx.drop("checkpointing.metric_name", _VALIDATION_OFF)
        tx.notice(
            f"checkpointing.metric_name: {name!r} ignored — no validation pass is scheduled, "
            "so checkpoints are not ranked (TandemRL keeps the latest checkpointing.keep_top_k)"
        )
        return
    mapped = _NEMO_RL_METRICS.get(str(name))
    if mapped is None:
        tx.refuse(
            "checkpointing.metric_name",
            f"the checkpoint metric {name!r}",
            "use a validation metric TandemRL reports: val/reward_mean, val/pass@<k>, "
            "val/mean_length, val/truncated_frac",
        )
        return
    tx.set("checkpointing.metric_name", mapped)
    tx.notice(
        f"checkpointing.metric_name: {name!r} carried over as {mapped!r}; TandemRL keeps the "
        "best checkpoint by it besides the latest checkpointing.keep_top_k (NeMo-RL keeps the "
        "top k by the metric)"
    )


def _attempts_to_retries(value: Any) -> Any:
    return value - 1 if isinstance(value, int) and value >= 1 else value


def _data(tx: _Translator) -> None:
    data = tx.get("data")
    if not isinstance(data, dict):
        return
    tx.ignore(
        "data.max_input_seq_length",
        "prompts are bounded by policy.max_total_sequence_length",
        tell=True,
    )
    tx.ignore("data.num_workers", "data loading runs in the controller")
    tx.inert(
        "data.use_multiple_dataloader",
        _off,
        "several dataloaders",
        "set data.use_multiple_dataloader: false",
    )
    _validation_data(tx)
    tx.inert(
        "data.system_prompt_file", _null, "system prompt files", "remove data.system_prompt_file"
    )
    default = tx.pop("data.default")
    default = default if isinstance(default, dict) else {}
    train = tx.pop("data.train")
    legacy_name = tx.pop("data.dataset_name")
    prompt_file = tx.pop("data.prompt_file")
    if prompt_file is _MISSING:
        prompt_file = default.get("prompt_file")
    if train is _MISSING and legacy_name is _MISSING:
        if prompt_file not in (_MISSING, None):
            tx.refuse(
                "data.prompt_file",
                f"prompt template files ({prompt_file})",
                "write the full prompts into your JSONL dataset",
            )
        return
    train = train if isinstance(train, dict) else {}
    settings = {**default, **train}
    if legacy_name is not _MISSING:
        settings.setdefault("dataset_name", legacy_name)
    path = settings.get("data_path")
    name = settings.get("dataset_name")
    if name == "NemoGymDataset" and path is not None:
        # Gym rows keep their own fields (responses_create_params, agent_ref, task_source).
        tx.set("data.dataset", path)
        tx.notice(f"data.train.data_path: carried over as data.dataset: {path} (NeMo-Gym rows)")
        for key in ("processor", "env_name", "dataset_name", "prompt_file", "system_prompt_file"):
            if key in settings:
                tx.drop(f"data.train.{key}", "NeMo-Gym rows need no processor")
        return
    if path is None:
        tx.refuse(
            "data.train",
            f"NeMo-RL's dataset {name!r} (hub datasets and processors)",
            "convert it to a local JSONL file (one object per line with a prompt and an "
            "answer field) and set data.dataset: PATH, data.prompt_key, data.answer_key",
            also=("data.dataset",),
        )
        return
    tx.set("data.dataset", path)
    tx.set("data.prompt_key", settings.get("input_key", "input"))
    tx.set("data.answer_key", settings.get("output_key", "output"))
    tx.notice(f"data.train.data_path: carried over as data.dataset: {path}")
    if prompt_file not in (_MISSING, None):
        tx.refuse(
            "data.default.prompt_file",
            f"prompt template files ({prompt_file})",
            "write the full prompts into your JSONL dataset",
        )
    for key in ("split_validation_size", "seed", "processor", "env_name", "dataset_name"):
        if key in settings:
            tx.drop(f"data.train.{key}", "validation split and processors are not used")


def _env(tx: _Translator) -> None:
    env = tx.get("env")
    if not isinstance(env, dict):
        return
    gym = tx.pop("env.should_use_nemo_gym")
    if gym is True:
        _nemo_gym(tx)
    elif gym is not _MISSING and tx.pop("env.nemo_gym") is not _MISSING:
        tx.drop("env.nemo_gym", "NeMo-Gym is off")
    # Without should_use_nemo_gym, env.nemo_gym is TandemRL's own block (env.name: nemo_gym).
    for key in ("should_log_nemo_gym_responses", "should_mask_flagged_samples"):
        tx.ignore(f"env.{key}", "logging and masking of NeMo-Gym rollouts")
    math_env = tx.pop("env.math")
    if isinstance(math_env, dict):
        if "name" not in env:
            tx.set("env.name", "math")
        tx.notice(
            "env.math: carried over as env.name: math — TandemRL's checker compares the "
            "number in \\boxed{}, after 'answer:' or the last number; NeMo-RL's math_verify "
            "also compares symbolic answers"
        )
        tx.drop("env.math", "workers and verifier of NeMo-RL's math environment")


# TandemRL's env.nemo_gym keys that a translation step writes before _nemo_gym reads the block.
_TANDEMRL_GYM_KEYS = ("run_timeout_s",)
# NeMo-RL's own knobs inside env.nemo_gym; every other key there is Gym's global config.
_GYM_NEMO_RL_KNOBS: dict[str, tuple[Predicate, str, str]] = {
    "is_trajectory_collection": (_off, "trajectory collection without training", ""),
    "pad_dynamic_image_shapes": (_off, "multimodal NeMo-Gym rows", ""),
    "require_routed_experts": (_off, "routed-expert replay (R3)", ""),
    "effort_levels": (_empty, "per-row reasoning effort levels", ""),
    "invalid_tool_call_patterns": (_empty, "masking samples with invalid tool calls", ""),
    "thinking_tags": (_empty, "masking samples with malformed thinking", ""),
    "shards": (_empty, "NeMo-Gym sharded across nodes", "run one Gym (no shards)"),
}
_GYM_IGNORED = {
    "rollout_max_attempts_to_avoid_lp_nan": "TandemRL trains on the logprobs the engine returned",
    "use_fastokens": "tokenizer patching of NeMo-RL's rollout actors",
    "token_capture": "NeMo-RL's receipt mode: TandemRL's endpoint captures every turn itself",
    "tokenizer_config": "NeMo-RL's processor reconstruction",
}


def _nemo_gym(tx: _Translator) -> None:
    """A NeMo-RL Gym config (env.should_use_nemo_gym: true) as env.name: nemo_gym."""
    block = tx.pop("env.nemo_gym")
    block = dict(block) if isinstance(block, dict) else {}
    tx.set("env.name", "nemo_gym")
    tx.notice("env.should_use_nemo_gym: carried over as env.name: nemo_gym (docs/nemo_gym.md)")
    config_paths = block.pop("config_paths", None)
    if config_paths:
        tx.set("env.nemo_gym.config_paths", list(config_paths))
    # Keys of TandemRL's own block already carried over (run_timeout_s, by _async_rl) stay.
    for key in _TANDEMRL_GYM_KEYS:
        if key in block:
            tx.set(f"env.nemo_gym.{key}", block.pop(key))
    for key, (harmless, what, todo) in _GYM_NEMO_RL_KNOBS.items():
        if key in block:
            tx.set(f"env.nemo_gym.{key}", block.pop(key))
            tx.inert(f"env.nemo_gym.{key}", harmless, what, todo)
    for key, reason in _GYM_IGNORED.items():
        if key in block:
            block.pop(key)
            tx.drop(f"env.nemo_gym.{key}", reason)
    if block:
        # Gym's own global config (policy_model overrides, port ranges, server settings).
        tx.set("env.nemo_gym.overrides", block)
        tx.notice(
            f"env.nemo_gym.{', '.join(sorted(block))}: carried over into env.nemo_gym.overrides "
            "(Gym global config merged after the config files)"
        )


def _logger(tx: _Translator) -> None:
    logger = tx.get("logger")
    if not isinstance(logger, dict):
        return
    enabled = tx.pop("logger.tensorboard_enabled")
    block = tx.get("logger.tensorboard")
    if isinstance(block, dict):
        tx.pop("logger.tensorboard")
        if set(block) - {"enabled"}:
            tx.drop("logger.tensorboard", "TensorBoard settings other than on/off")
        tx.set("logger.tensorboard", bool(block.get("enabled", True)))
    if enabled is not _MISSING:
        tx.set("logger.tensorboard", bool(enabled))
        tx.notice("logger.tensorboard_enabled: renamed to logger.tensorboard")
    for tracker in ("wandb", "mlflow"):
        tx.rename(f"logger.{tracker}_enabled", f"logger.{tracker}.enabled")
    tx.ignore("logger.wandb.log_nemo_gym_full_result_tables", "W&B tables of whole Gym responses")
    tx.inert("logger.swanlab_enabled", _off, "SwanLab", "use logger.wandb or logger.mlflow")
    tx.ignore("logger.swanlab", "SwanLab is not used")
    tx.ignore("logger.monitor_gpus", "GPU monitoring is not logged")
    tx.ignore("logger.gpu_monitoring", "GPU monitoring is not logged")
    tx.ignore("logger.num_val_samples_to_print", _NO_VAL_SAMPLES)


def _checkpoints(tx: _Translator) -> None:
    _checkpoint_metric(tx)
    tx.inert(
        "checkpointing.checkpoint_must_save_by",
        _null,
        "a deadline for the next checkpoint",
        "set checkpointing.checkpoint_must_save_by: null",
    )
    tx.inert(
        "checkpointing.model_save_format",
        _equals("safetensors"),
        "checkpoint formats other than safetensors",
        "remove it",
    )
    tx.ignore("checkpointing.save_consolidated", "TandemRL's checkpoints hold one model file")
    tx.rename(
        "rollout_checkpointing.interval_s", "rollout_checkpointing.snapshot_attempt_interval_s"
    )
    tx.ignore("token_capture.staging_partition", "TransferQueue partition name")
    tx.rename(
        "rollout_recovery.task_granularity_overrides",
        "rollout_recovery.task_source_granularity_overrides",
    )


def _cluster_and_data_plane(tx: _Translator) -> None:
    nodes = tx.get("cluster.num_nodes")
    gpus = tx.get("cluster.gpus_per_node")
    if nodes is not _MISSING or gpus is not _MISSING:
        tx.pop("cluster.num_nodes")
        tx.pop("cluster.gpus_per_node")
        tx.drop("cluster.gpus_per_node", "TandemRL uses the GPUs Ray sees")
        tx.notice(
            "cluster.num_nodes, cluster.gpus_per_node: ignored — TandemRL uses the GPUs the "
            "Ray cluster has (cluster.address for a running cluster, cluster.num_gpus to "
            "limit a local one)"
        )
    for key in ("master_port_range_low", "master_port_range_high", "segment_size"):
        tx.ignore(f"cluster.{key}", "ports and topology are Ray's")
    impl = tx.pop("data_plane.impl")
    if impl not in (_MISSING, None, "transfer_queue"):
        tx.refuse(
            "data_plane.impl", f"the data plane {impl!r}", "use data_plane.backend: local or simple"
        )
    backend = tx.get("data_plane.backend")
    if backend == "mooncake_cpu":
        tx.pop("data_plane.backend")
        tx.refuse(
            "data_plane.backend",
            f"the {backend} storage",
            "use data_plane.backend: local (in-process) or simple (TransferQueue)",
        )
    for key in (
        "storage_capacity",
        "claim_meta_poll_interval_s",
        "global_segment_size",
        "local_buffer_size",
        "observability",
    ):
        tx.ignore(f"data_plane.{key}", "sizing and polling of NeMo-RL's TransferQueue")


def _top_level(tx: _Translator) -> None:
    penalties = tx.pop("reward_penalties")
    if penalties is not _MISSING:
        active = isinstance(penalties, dict) and any(
            value for key, value in penalties.items() if key != "token_ids"
        )
        if active:
            tx.refuse(
                "reward_penalties",
                "NeMo-Gym reward penalties",
                "set every reward_penalties.penalize_* to false",
            )
        else:
            tx.drop("reward_penalties", "every penalty is off")
    # TandemRL's own on_policy_distillation: block is an algorithm block of its own; NeMo-RL's
    # MOPD block rides beside grpo: (with adv_estimator opd) and has another shape.
    if not _is_tandemrl_distillation(tx.tree):
        tx.inert(
            "on_policy_distillation",
            _null,
            "NeMo-RL's on-policy distillation block (adv_estimator opd beside grpo:)",
            "write TandemRL's on_policy_distillation: block in place of grpo: (its teachers, "
            "kl_coef, reward_coef: docs/distillation.md) and set the NeMo-RL one to null",
        )


def _is_tandemrl_distillation(tree: dict[str, Any]) -> bool:
    """An ``on_policy_distillation`` block in TandemRL's shape (a list of teachers, each a
    mapping), which passes through untouched; validation judges it with the other blocks."""
    block = tree.get("on_policy_distillation")
    if not isinstance(block, dict):
        return False
    teachers = block.get("teachers")
    return isinstance(teachers, list) and all(isinstance(entry, dict) for entry in teachers)


def _drop_if_empty(tx: _Translator, path: str) -> None:
    if tx.get(path) in ({}, None):
        tx.pop(path)


__all__ = ["Dropped", "Translation", "translate_nemo_rl"]
