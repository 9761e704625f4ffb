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

Two kinds of preset. The task presets (``qwen2-counting``, the default model, and
``llama-small``) read the built-in tasks as raw text. The architecture matrix
(``llama3``, ``qwen2.5``, ``qwen3``, ``mistral``, ``gemma3``, ``phi3``, ``qwen3-moe``) holds one
small model per family people post-train, each with its family's chat format
(``chat_formats.py``): a larger character alphabet, the turn markers as special tokens, a chat
template, and a generation config whose ``eos_token_id`` lists the end-of-turn token next to
the tokenizer's ``<eos>`` (Mistral: the ``<eos>`` alone). ``docs/models.md`` lists what each
family runs through.

``load_causal_lm`` and ``load_tokenizer`` go through the ordinary ``from_pretrained`` path, so
a preset and a real checkpoint are loaded by the same code.
"""

from __future__ import annotations

import dataclasses
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
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tandemrl.models.chat_formats import (
    CHATML,
    COUNTING_CHAT,
    GEMMA,
    LLAMA3,
    MISTRAL,
    PHI3,
    QWEN2_VL,
    ChatFormat,
)
from tandemrl.models.tokenizer import (
    CHAR_ALPHABET,
    CHAT_ALPHABET,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    build_char_tokenizer,
)

TINY_SCHEME = "tiny://"
CACHE_ENV_VAR = "TANDEMRL_CACHE"
# Written last into a preset folder; its presence marks the folder complete.
PRESET_MARKER = "tandemrl_preset.json"


@dataclass(frozen=True)
class TinyPreset:
    """A random-init architecture: a transformers ``model_type`` and its config's keyword
    arguments, the tokenizer's alphabet and, for a chat preset, its chat format."""

    architecture: str  # a transformers model_type: "qwen2", "llama", "gemma3_text", ...
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    alphabet: str = CHAR_ALPHABET
    seed: int = 0
    chat: ChatFormat | None = None
    # A vision-language preset: its model_type's vision_config and the keyword arguments of
    # its image processor (``config_kwargs`` then configure the text model).
    vision: dict[str, Any] | None = None
    image_processor: dict[str, Any] | None = None

    @property
    def extra_special_tokens(self) -> tuple[str, ...]:
        return self.chat.special_tokens if self.chat is not None else ()

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer = build_char_tokenizer(self.alphabet, self.extra_special_tokens)
        if self.chat is not None:
            tokenizer.chat_template = self.chat.template
        return tokenizer

    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet) + len(self.extra_special_tokens)

    def generation_eos_token_ids(self) -> int | list[int]:
        """``eos_token_id`` of the generation config: ``<eos>``, and a chat preset's
        end-of-turn token first when it is another token."""
        eos = SPECIAL_TOKENS.index(EOS_TOKEN)
        if self.chat is None or self.chat.end_of_turn == EOS_TOKEN:
            return eos
        end_of_turn = len(SPECIAL_TOKENS) + len(self.alphabet)
        end_of_turn += self.extra_special_tokens.index(self.chat.end_of_turn)
        return [end_of_turn, eos]

    def build_config(self) -> PretrainedConfig:
        # Special ids follow tokenizer.SPECIAL_TOKENS: <pad>=0, <eos>=1, <bos>=2.
        common = {
            "vocab_size": self.vocab_size(),
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
        }
        if self.vision is None:
            return AutoConfig.for_model(self.architecture, **common, **self.config_kwargs)
        return vision_model_config(self, common)

    def fingerprint(self) -> str:
        spec: dict[str, Any] = {
            "architecture": self.architecture,
            "config": self.config_kwargs,
            "alphabet": self.alphabet,
            "seed": self.seed,
            "special_tokens": SPECIAL_TOKENS,
        }
        if self.chat is not None:  # absent for the task presets: their folders keep their names
            spec["chat"] = [self.chat.special_tokens, self.chat.end_of_turn, self.chat.template]
        if self.vision is not None:
            spec["vision"] = [self.vision, self.image_processor]
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]


# M-RoPE of the tiny VLM: head_dim 32 = 16 rotary frequency pairs, split over the temporal,
# height and width axes (Qwen2-VL's [16, 24, 24] of 64 pairs, scaled down).
TINY_MROPE = {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0}

# The architecture matrix's common shape: about 0.1 M parameters each (the MoE about twice),
# created in well under a second.
MATRIX_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    # Heads of 32 dimensions: vLLM's CPU attention has no kernel for 16.
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    # Ten times transformers' default: next-token distributions far from uniform (entropy
    # about 3.4 nats of 4.5), so a logprob taken at the wrong position or under the wrong
    # weights shows; at 0.02 every family's distribution is nearly flat.
    "initializer_range": 0.2,
}

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
    # The default model's shape with a compact chat format (chat_formats.COUNTING_CHAT): the
    # agent exemplar's two-turn counting game (examples/configs/grpo_tiny_cpu_agent.yaml).
    "qwen2-counting-chat": TinyPreset(
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
        chat=COUNTING_CHAT,
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
    **{
        name: TinyPreset(architecture, {**MATRIX_SHAPE, **kwargs}, CHAT_ALPHABET, chat=chat)
        for name, (architecture, kwargs, chat) in {
            # Llama 3.2-shaped: tied embeddings, rope theta 5e5 with the llama3 rope scaling.
            "llama3": (
                "llama",
                {
                    "tie_word_embeddings": True,
                    "rope_theta": 500000.0,
                    "rope_scaling": {
                        "rope_type": "llama3",
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64,
                    },
                },
                LLAMA3,
            ),
            # Qwen2.5-shaped: QKV biases, tied embeddings.
            "qwen2.5": ("qwen2", {"tie_word_embeddings": True}, CHATML),
            # Qwen3: per-head RMSNorm of queries and keys, explicit head_dim.
            "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}, CHATML),
            # Mistral v0.3-shaped: no sliding window, untied.
            "mistral": ("mistral", {"sliding_window": None, "head_dim": 32}, MISTRAL),
            # Gemma 3 (text): a sliding-window layer then a global one, the window shorter
            # than the test sequences; tanh-GELU MLP, (1 + w) norms, scaled embeddings.
            "gemma3": (
                "gemma3_text",
                {
                    "head_dim": 32,
                    "query_pre_attn_scalar": 32,
                    "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "tie_word_embeddings": True,
                    # Gemma scales its embeddings by sqrt(hidden_size): a smaller init gives
                    # the same spread of next-token distributions as the other families.
                    "initializer_range": 0.1,
                },
                GEMMA,
            ),
            # Phi-3: fused qkv_proj and gate_up_proj, untied.
            "phi3": ("phi3", {"tie_word_embeddings": False}, PHI3),
            # Qwen2-VL: a one-block vision tower over 7-pixel patches (a 28 x 28 image is 16
            # patches, merged 2 x 2 into 4 tokens), M-RoPE over (temporal, height, width)
            # sections of the 32-dim heads; tied embeddings.
            "qwen2-vl": (
                "qwen2_vl",
                {"tie_word_embeddings": True, "rope_parameters": TINY_MROPE},
                QWEN2_VL,
            ),
            # Qwen3-MoE: 4 experts, 2 routed per token, every layer sparse.
            "qwen3-moe": (
                "qwen3_moe",
                {
                    "head_dim": 32,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 64,
                    "tie_word_embeddings": False,
                },
                CHATML,
            ),
        }.items()
    },
}
TINY_PRESETS["qwen2-vl"] = dataclasses.replace(
    TINY_PRESETS["qwen2-vl"],
    vision={
        "depth": 1,
        "embed_dim": 32,
        "hidden_size": MATRIX_SHAPE["hidden_size"],  # the merger's output: the text width
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 7,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "initializer_range": 0.2,
    },
    # Every image is resized to 28 x 28 (min = max pixels): cheap, and a fixed token count.
    image_processor={
        "patch_size": 7,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 28 * 28,
        "max_pixels": 28 * 28,
    },
)


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


def resolve_tokenizer_path(tokenizer_name: str | None, model_path: str | os.PathLike[str]) -> Path:
    """The folder to load the tokenizer from: ``policy.tokenizer.name`` (a ``tiny://`` preset
    or a folder of tokenizer files), else the model folder."""
    if tokenizer_name is None:
        return Path(model_path)
    if tokenizer_name.startswith(TINY_SCHEME):
        return resolve_model_path(tokenizer_name)
    path = Path(tokenizer_name).expanduser()
    if not path.is_dir():
        raise ModelPathError(
            f"policy.tokenizer.name={tokenizer_name!r}: no such folder; give a folder of "
            "tokenizer files (tokenizer.json, tokenizer_config.json), or null to use "
            "policy.model_name's"
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
    model_class = AutoModelForCausalLM if preset.vision is None else AutoModelForImageTextToText
    # fork_rng: seeding must not disturb the caller's global random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        model = model_class.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = preset.generation_eos_token_ids()
    model.generation_config.bos_token_id = 2
    model.save_pretrained(folder, safe_serialization=True)
    preset.build_tokenizer().save_pretrained(folder)  # with its chat template, if any
    if preset.vision is not None:
        save_vision_processor(preset, folder)


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


def vision_model_config(preset: TinyPreset, common: dict[str, Any]) -> PretrainedConfig:
    """The config of a vision-language preset: the text model from ``config_kwargs`` (with the
    special ids of ``common``), the vision tower from ``vision``, the vision tokens' ids."""
    tokens = preset.extra_special_tokens
    first = len(SPECIAL_TOKENS) + len(preset.alphabet)

    def token_id(token: str) -> int:
        return first + tokens.index(token)

    text = {**common, **preset.config_kwargs}
    return AutoConfig.for_model(
        preset.architecture,
        text_config=text,
        vision_config=dict(preset.vision or {}),
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
    )


def save_vision_processor(preset: TinyPreset, folder: Path) -> None:
    """The preset's processor files beside its tokenizer's: the image processor's
    ``preprocessor_config.json`` (``save_pretrained``) and ``processor_config.json`` naming the
    processor class; ``models.vision.load_processor`` reads them back through
    ``AutoProcessor``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    # The PIL/numpy image processor: the torchvision one does not import on the CPU build.
    Qwen2VLImageProcessorPil(**dict(preset.image_processor or {})).save_pretrained(folder)
    (folder / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n", encoding="utf-8"
    )


def preset_tokenizer_signature(model_name: str) -> tuple[str, ...] | None:
    """What a ``tiny://`` preset's tokenizer is made of (its special tokens, alphabet and chat
    tokens), read from the preset without any file; None for a folder or an unknown preset."""
    if not model_name.startswith(TINY_SCHEME):
        return None
    preset = TINY_PRESETS.get(model_name[len(TINY_SCHEME) :])
    if preset is None:
        return None
    return (*SPECIAL_TOKENS, preset.alphabet, *preset.extra_special_tokens)


def tokenizer_signature(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of a loaded tokenizer's vocabulary (token → id, added tokens included) and its
    special token ids: two tokenizers with one signature map every text to the same ids."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {
            name: getattr(tokenizer, name, None)
            for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
        },
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
