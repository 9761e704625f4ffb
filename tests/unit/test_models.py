"""Tiny presets: created with save_pretrained, reloaded with from_pretrained, seeded, atomic."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tandemrl.models import (
    CHAR_ALPHABET,
    TINY_PRESETS,
    ModelPathError,
    build_char_tokenizer,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from tandemrl.models.tiny import CACHE_ENV_VAR, PRESET_MARKER

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_path("tiny://qwen2-counting", tmp_path_factory.mktemp("models"))


def test_qwen2_counting_preset_shape_and_reload(qwen_path: Path) -> None:
    assert (qwen_path / "model.safetensors").is_file()
    assert (qwen_path / PRESET_MARKER).is_file()
    model = load_causal_lm(qwen_path, dtype="float32", device="cpu")
    tokenizer = load_tokenizer(qwen_path)
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers) == (128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.intermediate_size == 512
    assert config.max_position_embeddings == 128
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id
    # Tied: one tensor serves as input embedding and output projection.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not model.training
    assert 0.3e6 < sum(p.numel() for p in model.parameters()) < 0.6e6


def test_llama_small_preset(tmp_path: Path) -> None:
    path = resolve_model_path("tiny://llama-small", tmp_path)
    model = load_causal_lm(path, device="cpu")
    assert model.config.model_type == "llama"
    assert 1e6 <= sum(p.numel() for p in model.parameters()) <= 5e6
    assert model.config.vocab_size == len(load_tokenizer(path))


def test_preset_weights_are_deterministic_and_do_not_touch_global_rng(
    qwen_path: Path, tmp_path: Path
) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    other = resolve_model_path("tiny://qwen2-counting", tmp_path)
    assert torch.equal(torch.rand(3), expected_next)
    assert other != qwen_path
    first = load_file(qwen_path / "model.safetensors")
    second = load_file(other / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    # Not all-equal or zero: a real random init.
    embedding = first["model.embed_tokens.weight"]
    assert embedding.std() > 0.01


def test_second_resolve_reuses_the_folder(qwen_path: Path) -> None:
    stamp = (qwen_path / "model.safetensors").stat().st_mtime_ns
    again = resolve_model_path("tiny://qwen2-counting", qwen_path.parent)
    assert again == qwen_path
    assert (qwen_path / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((qwen_path / PRESET_MARKER).read_text())["preset"] == "qwen2-counting"


def test_cache_env_var_sets_the_default_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    path = resolve_model_path("tiny://qwen2-counting")
    assert path.parent == tmp_path / "models"
    assert path.name.startswith("qwen2-counting-")


def test_concurrent_creation_yields_one_complete_folder(tmp_path: Path) -> None:
    # A crashed earlier attempt left its temporary folder behind; it must not get in the way.
    crashed = tmp_path / ".qwen2-counting-deadbeef.tmp-1-0"
    crashed.mkdir()
    (crashed / "config.json").write_text("{")
    barrier = threading.Barrier(2)

    def resolve() -> Path:
        barrier.wait()
        return resolve_model_path("tiny://qwen2-counting", tmp_path)

    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda _: resolve(), range(2)))
    assert paths[0] == paths[1]
    # Only the published folder (and the crashed leftover) remain: no temporary folder of ours.
    assert sorted(entry.name for entry in tmp_path.iterdir()) == sorted(
        [crashed.name, paths[0].name]
    )
    load_causal_lm(paths[0], device="cpu")


@pytest.mark.parametrize("preset", ["qwen2-counting", "llama-small"])
def test_tokenizer_is_a_pure_character_split(preset: str, qwen_path: Path) -> None:
    # AutoTokenizer picks Qwen2Tokenizer for a qwen2 folder and the saved pipeline for llama:
    # both must give one id per character.
    path = resolve_model_path(f"tiny://{preset}", qwen_path.parent)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = build_char_tokenizer()
    text = "12+7=  -3.75 5/6 (1,2):"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one id per character, nothing added around it
    assert ids == reference(text)["input_ids"]
    assert [tokenizer.decode([token]) for token in ids] == list(text)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == len(reference) == load_causal_lm(path, device="cpu").config.vocab_size
    assert 15 <= len(tokenizer) <= 40
    eos = tokenizer.eos_token_id
    assert (tokenizer.pad_token_id, eos, tokenizer.bos_token_id) == (0, 1, 2)
    assert tokenizer.decode([*ids[:3], eos], skip_special_tokens=True) == "12+"
    assert tokenizer("<eos>1")["input_ids"] == [eos, reference("1")["input_ids"][0]]
    # Characters outside the alphabet are dropped, never mapped to a wrong character.
    assert tokenizer("7x8")["input_ids"] == reference("78")["input_ids"]


def test_tokenizer_round_trip_through_save_pretrained(tmp_path: Path) -> None:
    original = build_char_tokenizer()
    original.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == original.get_vocab()
    for char in CHAR_ALPHABET:
        assert loaded.decode(loaded(char)["input_ids"]) == char


def test_tokenizer_rejects_a_repeated_character() -> None:
    with pytest.raises(ValueError, match="repeats"):
        build_char_tokenizer("0123=3")


def test_unknown_preset_names_policy_model_name() -> None:
    with pytest.raises(ModelPathError, match=r"policy\.model_name.*tiny://nope"):
        resolve_model_path("tiny://nope")


def test_missing_local_folder_names_policy_model_name(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match=r"policy\.model_name=.*no such folder"):
        resolve_model_path(str(tmp_path / "absent"))


def test_local_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match=r"policy\.model_name=.*config\.json"):
        resolve_model_path(str(tmp_path))


def test_local_folder_is_returned_as_is(qwen_path: Path) -> None:
    assert resolve_model_path(str(qwen_path)) == qwen_path


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))


def test_presets_fit_the_tokenizer() -> None:
    for name, preset in TINY_PRESETS.items():
        config = preset.build_config().get_text_config()  # a VLM preset: its text model
        assert config.vocab_size == len(preset.build_tokenizer()), name
