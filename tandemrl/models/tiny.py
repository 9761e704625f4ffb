"""Model folders: built-in tiny presets (``tiny://<preset>``) and local transformers folders.

``resolve_model_path(policy.model_name)`` turns the config value into a folder that
``from_pretrained`` reads:

- ``tiny://<preset>``: a randomly initialised causal LM plus the character tokenizer, created
  on first use under the model cache folder (``cache_dir`` argument, else
  ``$TANDEMRL_CACHE/models``, else ``~/.cache/tandemrl/models``). The folder name carries a hash
  of the preset's definition (``qwen2-counting-1a2b3c4d``), so editing a preset never reuses a
  stale folder. Creation is seeded (same weights in every process) and atomic: everything is
  written to a temporary folder that is renamed into place, so a concurrent process or a
  restart after a crash sees either nothing or a complete folder.
- anything else: a local folder that must exist and hold ``config.json``.

``load_causal_lm`` and ``load_tokenizer`` go through the ordinary ``from_pretrained`` path, so
a preset and a real checkpoint are loaded by the same code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from tandemrl.models.tokenizer import CHAR_ALPHABET, SPECIAL_TOKENS, build_char_tokenizer

TINY_SCHEME = "tiny://"
CACHE_ENV_VAR = "TANDEMRL_CACHE"
# Written last into a preset folder; its presence marks the folder complete.
PRESET_MARKER = "tandemrl_preset.json"


@dataclass(frozen=True)
class TinyPreset:
    """A random-init architecture: a transformers config class and its keyword arguments."""

    architecture: str  # "qwen2" or "llama"
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    alphabet: str = CHAR_ALPHABET
    seed: int = 0

    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

    def build_config(self) -> PretrainedConfig:
        # Special ids follow tokenizer.SPECIAL_TOKENS: <pad>=0, <eos>=1, <bos>=2.
        common = {
            "vocab_size": self.vocab_size(),
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
        }
        config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[self.architecture]
        return config_class(**common, **self.config_kwargs)

    def fingerprint(self) -> str:
        spec = {
            "architecture": self.architecture,
            "config": self.config_kwargs,
            "alphabet": self.alphabet,
            "seed": self.seed,
            "special_tokens": SPECIAL_TOKENS,
        }
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]


TINY_PRESETS: dict[str, TinyPreset] = {
    # The default model: learns the counting task in under a minute on one CPU thread.
    "qwen2-counting": TinyPreset(
        architecture="qwen2",
        config_kwargs={
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "tie_word_embeddings": True,
            "max_position_embeddings": 128,
        },
    ),
    # A second architecture (untied embeddings, no attention bias), about 3.2 M parameters.
    "llama-small": TinyPreset(
        architecture="llama",
        config_kwargs={
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 688,
            "tie_word_embeddings": False,
            "max_position_embeddings": 256,
        },
    ),
}


class ModelPathError(ValueError):
    """``policy.model_name`` does not name a usable model."""


def default_models_dir() -> Path:
    root = os.environ.get(CACHE_ENV_VAR)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tandemrl"
    return base / "models"


def resolve_model_path(model_name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder to load ``model_name`` (``policy.model_name``) from, creating tiny presets."""
    if model_name.startswith(TINY_SCHEME):
        preset_name = model_name[len(TINY_SCHEME) :]
        if preset_name not in TINY_PRESETS:
            raise ModelPathError(
                f"policy.model_name={model_name!r}: unknown tiny preset {preset_name!r}; "
                f"choose one of {sorted(TINY_SCHEME + name for name in TINY_PRESETS)}"
            )
        models_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_models_dir()
        return ensure_tiny_model(preset_name, models_dir)
    path = Path(model_name).expanduser()
    if not path.is_dir():
        raise ModelPathError(
            f"policy.model_name={model_name!r}: no such folder; give a local transformers model "
            f"folder (with config.json) or one of "
            f"{sorted(TINY_SCHEME + name for name in TINY_PRESETS)}"
        )
    if not (path / "config.json").is_file():
        raise ModelPathError(
            f"policy.model_name={model_name!r}: folder {path} has no config.json; point it at a "
            "folder written by save_pretrained"
        )
    return path


def ensure_tiny_model(preset_name: str, models_dir: Path) -> Path:
    """The folder of a tiny preset under ``models_dir``, written atomically if missing."""
    preset = TINY_PRESETS[preset_name]
    final = models_dir / f"{preset_name}-{preset.fingerprint()}"
    if (final / PRESET_MARKER).is_file():
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = models_dir / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_tiny_model(preset, tmp)
        (tmp / PRESET_MARKER).write_text(
            json.dumps({"preset": preset_name, "fingerprint": preset.fingerprint()}) + "\n"
        )
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy first; identical by construction (seeded).
            if not (final / PRESET_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_tiny_model(preset: TinyPreset, folder: Path) -> None:
    """Seeded random init of ``preset``, saved with its tokenizer into ``folder``."""
    config = preset.build_config()
    # fork_rng: seeding must not disturb the caller's global random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    build_char_tokenizer(preset.alphabet).save_pretrained(folder)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 elsewhere (``policy.precision``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {['auto', *names]}")
    return names[dtype]


def load_causal_lm(
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
) -> PreTrainedModel:
    """A causal LM from a folder, on ``device`` in ``dtype``, in eval mode."""
    target = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=resolve_dtype(dtype, target), attn_implementation="sdpa"
    )
    return model.to(target).eval()


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))
