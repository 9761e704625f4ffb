"""Prompts as real models expect them: chat templates, system prompts, conversations, stop ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tandemrl.config import ConfigError, load_config, validate_single_controller_config
from tandemrl.config.models import DataConfig
from tandemrl.controller.actor import run_text_codec
from tandemrl.data.dataset import DatasetError, load_prompt_records
from tandemrl.data.prompt_format import PromptFormatError, PromptRenderer
from tandemrl.models import TINY_PRESETS, load_tokenizer, resolve_model_path
from tandemrl.models.special_tokens import model_eos_token_ids, pad_token_id, stop_token_ids
from tandemrl.records import PromptItem

DEFAULT = "examples/configs/grpo_tiny_cpu.yaml"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prompt-models")


def preset(name: str, models_dir: Path) -> Path:
    return resolve_model_path(f"tiny://{name}", models_dir)


def item(prompt: str, **metadata) -> PromptItem:
    return PromptItem("e0-i0", 0, 0, prompt, answer=7, metadata=metadata)


@pytest.mark.parametrize(
    ("family", "generation_prompt"),
    [
        ("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        ("qwen2.5", "<|im_start|>assistant\n"),
        ("gemma3", "<start_of_turn>model\n"),
    ],
)
def test_chat_rendering_is_the_tokenizers_own_template(
    family: str, generation_prompt: str, models_dir: Path
) -> None:
    folder = preset(family, models_dir)
    tokenizer = load_tokenizer(folder)
    cfg = load_config(
        DEFAULT,
        (
            f"policy.model_name={folder}",
            "data.prompt_format=chat",
            "data.system_prompt=Reply with the number.",
        ),
    )
    codec = run_text_codec(cfg, str(folder))
    expected_messages = [
        {"role": "system", "content": "Reply with the number."},
        {"role": "user", "content": "3+4="},
    ]
    expected_text = tokenizer.apply_chat_template(
        expected_messages, tokenize=False, add_generation_prompt=True
    )
    assert codec.render_prompt is not None
    assert codec.render_prompt(item("3+4=")) == expected_text
    assert expected_text.endswith(generation_prompt) and "3+4=" in expected_text
    expected_ids = tokenizer.apply_chat_template(
        expected_messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert codec.encode_prompt(item("3+4=")) == list(expected_ids)
    # Each turn marker is one special token of the tokenizer, not a run of characters.
    chat_format = TINY_PRESETS[family].chat
    assert chat_format is not None
    marker_ids = tokenizer.convert_tokens_to_ids(list(chat_format.special_tokens))
    assert len(set(marker_ids) & set(expected_ids)) >= 2


def test_raw_format_encodes_the_prompt_text_as_it_is(models_dir: Path) -> None:
    folder = preset("qwen2.5", models_dir)
    codec = run_text_codec(load_config(DEFAULT, (f"policy.model_name={folder}",)), str(folder))
    assert codec.render_prompt is None
    assert codec.encode_prompt(item("3+4=")) == load_tokenizer(folder).encode(
        "3+4=", add_special_tokens=False
    )


def test_a_conversation_keeps_its_own_system_message(models_dir: Path) -> None:
    tokenizer = load_tokenizer(preset("qwen3", models_dir))
    renderer = PromptRenderer(tokenizer, prompt_format="chat", system_prompt="Be brief.")
    own = [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3="},
    ]
    assert renderer.messages(item("and 3+3=", messages=own)) == own
    without_system = own[1:]
    assert renderer.messages(item("and 3+3=", messages=without_system)) == [
        {"role": "system", "content": "Be brief."},
        *without_system,
    ]
    text = renderer.text(item("and 3+3=", messages=own))
    assert text.count("<|im_start|>") == 5 and text.endswith("<|im_start|>assistant\n")


def test_jsonl_rows_may_hold_a_conversation_instead_of_a_prompt(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    conversation = [
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3="},
    ]
    rows = [{"messages": conversation, "answer": 6}, {"prompt": "1+1=", "answer": 2}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    chat = DataConfig(dataset=str(path), prompt_format="chat")
    first, second = load_prompt_records(chat)
    assert first.prompt == "and 3+3=" and first.metadata["messages"] == conversation
    assert second.prompt == "1+1=" and "messages" not in second.metadata
    # A raw run cannot render the conversation and says so, naming the file, line and keys.
    with pytest.raises(DatasetError, match=r"chat\.jsonl:1: .*data\.messages_key.*prompt_format"):
        load_prompt_records(DataConfig(dataset=str(path)))


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "user"}], "no string 'content'"),
        (["2+2="], "is a str, not an object"),
    ],
)
def test_malformed_conversations_name_the_line_and_field(
    tmp_path: Path, messages: object, problem: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": messages, "answer": 1}) + "\n")
    with pytest.raises(DatasetError, match=rf"bad\.jsonl:1: field 'messages' .*{problem}"):
        load_prompt_records(DataConfig(dataset=str(path), prompt_format="chat"))


def test_chat_format_is_refused_for_a_tokenizer_without_a_chat_template(
    models_dir: Path,
) -> None:
    raw_preset = preset("qwen2-counting", models_dir)
    with pytest.raises(PromptFormatError, match=r"data\.prompt_format: chat needs .*template"):
        PromptRenderer(load_tokenizer(raw_preset), prompt_format="chat")
    # tandemrl validate: the task preset by name, a local folder by loading its tokenizer.
    for model_name in ("tiny://qwen2-counting", str(raw_preset)):
        cfg = load_config(DEFAULT, (f"policy.model_name={model_name}", "data.prompt_format=chat"))
        with pytest.raises(ConfigError) as error:
            validate_single_controller_config(cfg)
        (message,) = error.value.messages
        assert message.startswith("data.prompt_format: chat needs a tokenizer with a chat")
        assert f"policy.model_name={model_name!r}" in message
    chat_folder = load_config(
        DEFAULT, (f"policy.model_name={preset('phi3', models_dir)}", "data.prompt_format=chat")
    )
    assert validate_single_controller_config(chat_folder) == []
    # A folder that exists only on another machine (the GPU box) cannot be checked here.
    elsewhere = load_config(
        DEFAULT, ("policy.model_name=/absent/smollm2", "data.prompt_format=chat")
    )
    (warning,) = validate_single_controller_config(elsewhere)
    assert "checked only when the run starts" in warning


def test_chat_only_keys_are_refused_in_raw_format() -> None:
    for override in ("data.system_prompt=Be brief.", "data.messages_key=conversation"):
        with pytest.raises(ConfigError, match=r"applies to data\.prompt_format: chat only"):
            validate_single_controller_config(load_config(DEFAULT, (override,)))


def test_stop_ids_gather_every_eos_of_the_folder_and_the_configured_stops(
    models_dir: Path,
) -> None:
    folder = preset("llama3", models_dir)
    tokenizer = load_tokenizer(folder)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    # generation_config.json lists [<|eot_id|>, <eos>]; config.json and the tokenizer say <eos>.
    assert model_eos_token_ids(folder) == [end_of_turn, tokenizer.eos_token_id]
    header = tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    assert stop_token_ids(
        tokenizer, folder, extra_ids=[7], stop_strings=["<|start_header_id|>", "\n"]
    ) == (end_of_turn, tokenizer.eos_token_id, 7, header, newline)
    with pytest.raises(ValueError, match=r"policy\.generation\.stop_strings: 'The end' is 7 tok"):
        stop_token_ids(tokenizer, folder, stop_strings=["The end"])


def test_a_folder_whose_eos_is_not_the_end_of_turn_stops_with_a_stop_string(
    models_dir: Path, tmp_path: Path
) -> None:
    """The SmolLM2 folder converted from GGUF on the GPU box reports <|im_start|> as EOS in
    every file while its turns end with <|im_end|>: policy.generation.stop_strings adds it."""
    folder = tmp_path / "gguf-like"
    shutil.copytree(preset("qwen2.5", models_dir), folder)
    tokenizer = load_tokenizer(folder)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for name in ("generation_config.json", "config.json"):
        data = json.loads((folder / name).read_text())
        data["eos_token_id"] = im_start
        (folder / name).write_text(json.dumps(data))
    tokenizer.eos_token = "<|im_start|>"
    assert im_end not in stop_token_ids(tokenizer, folder)
    assert stop_token_ids(tokenizer, folder, stop_strings=["<|im_end|>"]) == (im_start, im_end)


def test_a_tokenizer_without_a_pad_token_pads_with_a_model_id(
    models_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "no-pad"
    shutil.copytree(preset("llama3", models_dir), folder)
    tokenizer = load_tokenizer(folder)
    assert pad_token_id(tokenizer, folder) == 0  # the tokenizer's own
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    assert pad_token_id(tokenizer, folder) == 0  # the generation config's
    generation = json.loads((folder / "generation_config.json").read_text())
    del generation["pad_token_id"]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert pad_token_id(tokenizer, folder) == end_of_turn  # the first stop id
