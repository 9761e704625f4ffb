"""A dataset row's images (``data.image_key``), decoded for the model's processor.

The field holds one image or a list of them; each image is one of:

- a string: a path to an image file (relative paths are read from the dataset file's folder),
  or a ``data:image/<type>;base64,<bytes>`` URI holding the file's bytes;
- ``{"bytes": "<base64>"}``: the bytes of an image file, base64 encoded (JSONL holds text);
- a nested list of numbers: the pixels as an [height, width] (grey) or [height, width, 3 or 4]
  array of integers 0-255.

Pillow decodes files and bytes and turns arrays into images; nothing else touches the pixels:
resizing, normalising and patching are the processor's (``models.vision.load_processor``).

Every problem is an ``ImageError`` that names the field, which image of it and what is wrong:
a missing or unreadable file, bytes that are not an image (or a truncated one), an array of
the wrong shape or range, an image over ``data.max_image_pixels`` (checked from the header,
before the pixels are decoded). The rollout turns it into a data failure of that prompt.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

DATA_URI_PREFIX = "data:"


class ImageError(ValueError):
    """A row's image that cannot be given to the model; the message says which and why."""


def row_images(
    value: Any, *, field: str, base_dir: Path | None, max_pixels: int
) -> list[Image.Image]:
    """The images of a row's ``field`` value, decoded (see the module docstring)."""
    entries = value if _is_image_list(value) else [value]
    if not entries:
        raise ImageError(f"field {field!r} (data.image_key) holds an empty list of images")
    images = []
    for index, entry in enumerate(entries):
        where = f"field {field!r} (data.image_key)" + (
            f" image {index}" if len(entries) > 1 else ""
        )
        image = _decode(entry, where, base_dir)
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(
                f"{where}: {width} x {height} = {width * height} pixels is over "
                f"data.max_image_pixels={max_pixels}; shrink the image or raise the limit"
            )
        try:
            image.load()  # decode now: a truncated or corrupt file fails here, not later
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageError(f"{where}: the image data is corrupt ({exc})") from exc
        images.append(image)
    return images


def _is_image_list(value: Any) -> bool:
    """A list of images (strings or objects), as opposed to one image given as an array."""
    return isinstance(value, list) and all(isinstance(entry, str | dict) for entry in value)


def _decode(entry: Any, where: str, base_dir: Path | None) -> Image.Image:
    if isinstance(entry, str):
        if entry.startswith(DATA_URI_PREFIX):
            header, separator, payload = entry.partition(",")
            if not separator or not header.endswith(";base64"):
                raise ImageError(
                    f"{where}: a data URI must read 'data:image/<type>;base64,<bytes>'"
                )
            return _open_bytes(_b64decode(payload, where), where)
        return _open_file(entry, where, base_dir)
    if isinstance(entry, dict):
        if set(entry) != {"bytes"} or not isinstance(entry["bytes"], str):
            raise ImageError(
                f"{where}: an image object must be {{'bytes': '<base64>'}}, got keys "
                f"{sorted(entry)}"
            )
        return _open_bytes(_b64decode(entry["bytes"], where), where)
    if isinstance(entry, list):
        return _from_array(entry, where)
    raise ImageError(
        f"{where}: expected a path, a data URI, {{'bytes': ...}} or a nested pixel array, got "
        f"{type(entry).__name__}"
    )


def _b64decode(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{where}: the bytes are not valid base64 ({exc})") from exc


def _open_bytes(data: bytes, where: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{where}: the bytes are not an image Pillow can read ({exc})") from exc


def _open_file(name: str, where: str, base_dir: Path | None) -> Image.Image:
    path = Path(name).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise ImageError(f"{where}: no such image file {str(path)!r}")
    try:
        return Image.open(path)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{where}: {str(path)!r} is not an image Pillow can read ({exc})") from exc


def _from_array(entry: list[Any], where: str) -> Image.Image:
    try:
        array = np.asarray(entry)
    except ValueError as exc:  # ragged nesting
        raise ImageError(f"{where}: the pixel array is ragged ({exc})") from exc
    if array.dtype.kind not in "iu" or array.size == 0:
        raise ImageError(
            f"{where}: a pixel array holds integers 0-255, got dtype {array.dtype} "
            f"with {array.size} values"
        )
    shape_ok = array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))
    if not shape_ok:
        raise ImageError(
            f"{where}: a pixel array is [height, width] or [height, width, 3 or 4], got shape "
            f"{list(array.shape)}"
        )
    if int(array.min()) < 0 or int(array.max()) > 255:
        raise ImageError(
            f"{where}: pixel values must be 0-255, got {int(array.min())}..{int(array.max())}"
        )
    return Image.fromarray(array.astype(np.uint8))
