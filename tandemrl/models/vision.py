"""Vision-language models (``policy.is_vlm``): their folders, processors and position ids.

A VLM folder is what ``save_pretrained`` writes for an image-text-to-text model: a
``config.json`` with a ``vision_config``, the weights, the tokenizer files and the processor's
files (``preprocessor_config.json``, ``processor_config.json``, a chat template). Supported
families (``VLM_MODEL_TYPES``): Qwen2-VL and Qwen2.5-VL, whose processor turns an image into
``pixel_values`` [patches, channels x temporal x patch x patch] and ``image_grid_thw``
[images, 3], and whose language model places tokens with 3-D rotary positions (temporal,
height, width) that ``get_rope_index`` computes from the prompt's image placeholders.

- ``load_vision_lm``: the model through ``AutoModelForImageTextToText.from_pretrained``.
- ``load_processor``: the folder's processor through ``AutoProcessor.from_pretrained``. In
  transformers 5.19 every Qwen-VL processor also loads a video processor, which needs
  torchvision; where torchvision is missing (the CPU machines: PyPI's torchvision does not
  import beside the CPU torch build) the same processor class is built from the folder's own
  image processor (its PIL/numpy implementation), tokenizer and chat template, without the
  video part, and that is logged. Images are processed identically either way; videos are
  not supported by TandemRL.
- ``image_embeddings``: the input embeddings with the vision encoder's output at the prompt's
  image placeholders (only the prompt's: a placeholder id sampled into a completion is text).
- ``vision_position_ids``: the rotary positions of a batch of token rows (left or right
  padded) and each row's delta, ``max position + 1 - real length``: the position of a text
  token generated after the prompt is its index in the row plus that delta (what the engine
  feeds at every decode step). The engine's prefill and the trainer's forward both take their
  positions from here, so that the importance weight of a synchronous step is exactly 1.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# model_type values of the image-text-to-text families TandemRL runs (tests/unit/test_vlm*.py).
VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# Processor outputs that describe the text, not the images; everything else the processor
# returns for a prompt (pixel_values, image_grid_thw, ...) is the prompt's image inputs.
TEXT_OUTPUTS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"})
# Token types of get_rope_index: 0 text, 1 image, 2 video.
_IMAGE_TYPE, _VIDEO_TYPE = 1, 2


class VisionModelError(ValueError):
    """A model folder that cannot serve ``policy.is_vlm`` as asked; names the key and the fix."""


def folder_model_type(path: str | os.PathLike[str]) -> tuple[str | None, bool]:
    """(``model_type``, whether the config has a ``vision_config``) of a model folder."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise VisionModelError(f"policy.model_name: cannot read {config_path} ({exc})") from exc
    return config.get("model_type"), "vision_config" in config


def vlm_folder_problem(path: str | os.PathLike[str], *, is_vlm: bool, name: str) -> str | None:
    """Why the folder at ``path`` (``policy.model_name=name``) does not fit ``policy.is_vlm``,
    or None when it does."""
    model_type, has_vision = folder_model_type(path)
    if not is_vlm:
        if has_vision:
            return (
                f"policy.model_name={name!r} is a vision-language model (model_type "
                f"{model_type!r}); set policy.is_vlm: true (with data.image_key) to train it"
            )
        return None
    if not has_vision:
        return (
            f"policy.is_vlm: true, but policy.model_name={name!r} is a text-only model "
            f"(model_type {model_type!r}, no vision_config); give an image-text-to-text folder "
            f"({', '.join(VLM_MODEL_TYPES)}) or set policy.is_vlm: false"
        )
    if model_type not in VLM_MODEL_TYPES:
        return (
            f"policy.is_vlm: true, but policy.model_name={name!r} has model_type "
            f"{model_type!r}; TandemRL runs the vision-language families "
            f"{', '.join(VLM_MODEL_TYPES)} (their processors and 3-D rotary positions are "
            "what it reproduces between generation and training)"
        )
    if not (Path(path) / "preprocessor_config.json").is_file():
        return (
            f"policy.model_name={name!r}: {Path(path) / 'preprocessor_config.json'} is missing; "
            "a vision-language folder needs its processor's files (processor.save_pretrained)"
        )
    return None


def load_vision_lm(
    path: str | os.PathLike[str], dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """An image-text-to-text model from a folder, on ``device`` in ``dtype``, in eval mode."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        str(path), dtype=dtype, attn_implementation="sdpa"
    )
    return model.to(device).eval()


def load_processor(path: str | os.PathLike[str]) -> Any:
    """The folder's processor (module docstring: the fallback where torchvision is missing)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(path))
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
        processor = _image_only_processor(Path(path))
        log.info(
            "processor of %s: AutoProcessor needs torchvision for its video processor, which "
            "is not installed; using %s with the folder's image processor (%s) and tokenizer, "
            "without video support",
            path,
            type(processor).__mro__[1].__name__,
            type(processor.image_processor).__name__,
        )
        return processor


def _image_only_processor(path: Path) -> Any:
    """The folder's processor class over its image processor and tokenizer, no video part."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import processor_class_from_name

    config_path = path / "processor_config.json"
    processor_config = (
        json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    )
    class_name = processor_config.get("processor_class")
    if class_name is None:
        model_type = AutoConfig.from_pretrained(str(path)).model_type
        class_name = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(
            model_type
        )
    processor_class = processor_class_from_name(class_name) if class_name else None
    if processor_class is None:
        raise VisionModelError(
            f"policy.model_name={str(path)!r}: cannot tell its processor class (no "
            "processor_class in processor_config.json); save the processor with save_pretrained"
        )

    class ImageOnlyProcessor(processor_class):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None  # its class needs torchvision; images never use it
            return super().check_argument_for_proper_class(argument_name, argument)

    chat_template = None
    template_path = path / "chat_template.jinja"
    if template_path.is_file():
        chat_template = template_path.read_text(encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return ImageOnlyProcessor(
        image_processor=AutoImageProcessor.from_pretrained(str(path)),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=chat_template or getattr(tokenizer, "chat_template", None),
    )


def processor_image_token(processor: Any) -> str:
    """The placeholder the processor expands into one token per merged image patch."""
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str) or not token:
        raise VisionModelError(
            f"{type(processor).__name__} names no image_token; TandemRL runs the processors of "
            f"{', '.join(VLM_MODEL_TYPES)}"
        )
    return token


def modality_token_types(
    input_ids: torch.Tensor, config: Any, prompt_mask: torch.Tensor
) -> torch.Tensor:
    """``mm_token_type_ids`` of ``input_ids``: 1 at the prompt's image placeholders, 2 at its
    video ones, 0 elsewhere. A placeholder id the model *generated* (after the prompt) is a
    text token: it was fed to the model as one, with no image behind it."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types = types.masked_fill((input_ids == config.image_token_id) & prompt_mask, _IMAGE_TYPE)
    return types.masked_fill((input_ids == config.video_token_id) & prompt_mask, _VIDEO_TYPE)


def vision_position_ids(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    prompt_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [3, B, L], deltas [B]) of token rows [B, L] (module docstring).

    ``image_grid_thw`` holds the rows' images in row order, as the processor returned them;
    ``prompt_mask`` [B, L] marks each row's prompt (where its image placeholders are); padding
    positions get 0 (they are masked out)."""
    if image_grid_thw is None or image_grid_thw.numel() == 0:
        # No image anywhere: plain positions, the same on all three axes.
        text = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        return text.unsqueeze(0).expand(3, -1, -1), torch.zeros(
            input_ids.shape[0], dtype=torch.long, device=input_ids.device
        )
    positions, deltas = model.model.get_rope_index(  # Qwen2VLModel / Qwen2_5_VLModel
        input_ids,
        modality_token_types(input_ids, model.config, prompt_mask),
        image_grid_thw=image_grid_thw,
        attention_mask=attention_mask,
    )
    return positions, deltas.reshape(-1).to(torch.long)


def image_embeddings(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
) -> torch.Tensor:
    """The input embeddings of token rows [B, L] with the vision encoder's output at the
    prompts' image placeholders (in row order, one per merged patch).

    Built here rather than by the model's forward, which would take *every* placeholder id as
    an image slot, those a model generated after its prompt included; fed to the model as
    ``inputs_embeds`` with explicit positions, by the engine's prefill and the trainer alike."""
    embeds = model.get_input_embeddings()(input_ids)
    if pixel_values is None or image_grid_thw is None or image_grid_thw.numel() == 0:
        return embeds
    pooled = model.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
    features = torch.cat(list(pooled.pooler_output)).to(embeds.dtype)
    slots = (input_ids == model.config.image_token_id) & prompt_mask
    if int(slots.sum()) != features.shape[0]:
        raise ValueError(
            f"the prompts hold {int(slots.sum())} image placeholders for {features.shape[0]} "
            "image features; token ids and images must come from one processor call"
        )
    return embeds.masked_scatter(slots.unsqueeze(-1), features)


def is_vision_model(model: torch.nn.Module) -> bool:
    """True for a loaded image-text-to-text model (its config has a vision tower)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def load_policy_model(
    path: str | os.PathLike[str], dtype: str | torch.dtype, device: str | torch.device
) -> torch.nn.Module:
    """The model of a folder for the engine and the trainer: an image-text-to-text model when
    its config has a ``vision_config``, else a causal LM (``tiny.load_causal_lm``)."""
    from tandemrl.models.tiny import load_causal_lm, resolve_device, resolve_dtype

    _model_type, has_vision = folder_model_type(path)
    if not has_vision:
        return load_causal_lm(path, dtype=dtype, device=device)
    target = resolve_device(device)
    return load_vision_lm(path, resolve_dtype(dtype, target), target)
