"""A vision-language prompt: its images and text through the model's own processor.

``VisionPromptEncoder.encode(item)`` returns the prompt's token ids and its processed images
(the processor's outputs besides the text: ``pixel_values``, ``image_grid_thw`` for Qwen2-VL):

1. the row's ``data.image_key`` field is decoded (``images.row_images``: a path, a data URI,
   base64 bytes or a pixel array; Pillow decodes, nothing else touches the pixels);
2. the text is rendered in ``data.prompt_format``:
   - ``raw``: the prompt as it is when it already holds the processor's image placeholder
     once per image (``<|image_pad|>`` for Qwen2-VL), else one placeholder per image
     before it;
   - ``chat``: the conversation ``PromptRenderer.messages`` gives, its first user message's
     text turned into ``[{"type": "image"}, ..., {"type": "text", "text": ...}]`` (unless it
     already lists its parts), rendered by the processor's chat template with
     ``add_generation_prompt``;
3. the processor takes text and images together and expands each placeholder into the
   image's tokens (one per merged patch), so token ids and pixel tensors always agree.

Any problem with the row's images (``images.ImageError``) is raised naming the dataset row
(``dataset_index``) and the prompt; the rollout manager makes it a data failure of that prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandemrl.data.images import ImageError, row_images
from tandemrl.data.prompt_format import PromptRenderer
from tandemrl.models.vision import TEXT_OUTPUTS, processor_image_token
from tandemrl.records import PromptItem


class VisionPromptEncoder:
    """Encodes prompts with images for one processor (see the module docstring)."""

    def __init__(
        self,
        processor: Any,
        *,
        image_key: str = "image",
        max_image_pixels: int = 4096 * 4096,
        base_dir: Path | None = None,
        prompt_format: str = "raw",
        system_prompt: str | None = None,
        messages_key: str = "messages",
    ) -> None:
        self.processor = processor
        self.image_token = processor_image_token(processor)
        self.image_key = image_key
        self.max_image_pixels = max_image_pixels
        self.base_dir = base_dir
        self.prompt_format = prompt_format
        # The renderer's checks (a chat template exists) apply to the processor's template.
        self.renderer = PromptRenderer(
            processor,
            prompt_format=prompt_format,
            system_prompt=system_prompt,
            messages_key=messages_key,
        )

    def images(self, item: PromptItem) -> list[Any]:
        """The prompt's images, decoded; ImageError naming the row when they cannot be."""
        where = f"prompt {item.prompt_id} (data.dataset row {item.metadata.get('dataset_index')})"
        if self.image_key not in item.metadata:
            raise ImageError(f"{where}: the row has no field {self.image_key!r} (data.image_key)")
        try:
            return row_images(
                item.metadata[self.image_key],
                field=self.image_key,
                base_dir=self.base_dir,
                max_pixels=self.max_image_pixels,
            )
        except ImageError as exc:
            raise ImageError(f"{where}: {exc}") from exc

    def text(self, item: PromptItem, num_images: int) -> str:
        """The prompt's text with its image placeholders (module docstring)."""
        if self.prompt_format == "raw":
            placeholders = item.prompt.count(self.image_token)
            if placeholders == 0:
                return self.image_token * num_images + item.prompt
            if placeholders != num_images:
                raise ImageError(
                    f"prompt {item.prompt_id}: its text holds {placeholders} image placeholders "
                    f"({self.image_token!r}) for {num_images} images in {self.image_key!r}"
                )
            return item.prompt
        messages: list[dict[str, Any]] = list(self.renderer.messages(item))
        for index, message in enumerate(messages):
            if message["role"] == "user":
                if isinstance(message["content"], str):
                    parts = [{"type": "image"}] * num_images
                    messages[index] = {
                        **message,
                        "content": [*parts, {"type": "text", "text": message["content"]}],
                    }
                break
        return str(
            self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )

    def encode(self, item: PromptItem) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(prompt token ids, processed images) of ``item``."""
        images = self.images(item)
        outputs = self.processor(
            text=[self.text(item, len(images))], images=images, return_tensors="pt"
        )
        token_ids = outputs["input_ids"][0].tolist()
        image_inputs = {name: value for name, value in outputs.items() if name not in TEXT_OUTPUTS}
        return token_ids, image_inputs
