"""How a dataset prompt becomes the text the model is given (``data.prompt_format``).

- ``raw`` (the default): the prompt text as it is — the tiny task presets, base models.
- ``chat``: a conversation rendered with the tokenizer's own chat template and
  ``add_generation_prompt=True``, the way an instruct model was trained to be asked. The
  conversation is the row's ``messages`` (the JSONL field ``data.messages_key``: a list of
  ``{"role": ..., "content": ...}``) when it has one, else the prompt as one user message; a
  ``data.system_prompt`` goes first as a system message unless the conversation already opens
  with one. The rendered text is encoded without adding special tokens: the template writes
  the ones the model expects (BOS, turn markers).

``PromptRenderer.text(item)`` is what the rollout encodes for each prompt group. A tokenizer
without a chat template cannot do ``chat``: the renderer refuses it when it is built (before any
prompt is generated), and ``tandemrl validate`` refuses it for a model folder it can read
(``chat_template_problem``).
"""

from __future__ import annotations

from typing import Any

from tandemrl.records import PromptItem

PROMPT_FORMATS = ("raw", "chat")
ROLES = ("system", "user", "assistant", "tool")


class PromptFormatError(ValueError):
    """``data.prompt_format`` cannot be applied to this tokenizer or prompt."""


def check_messages(value: Any) -> list[dict[str, str]]:
    """``value`` as a conversation, or ValueError saying what is wrong with it."""
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty list of {'role': ..., 'content': ...} objects")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"entry {index} is a {type(message).__name__}, not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"entry {index} has role {role!r}; use one of {list(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"entry {index} has no string 'content'")
    return value


def last_user_content(messages: list[dict[str, str]]) -> str:
    """The text of the conversation's last user message ('' when it has none)."""
    for message in reversed(messages):
        if message["role"] == "user":
            return message["content"]
    return ""


class PromptRenderer:
    """Renders prompts in ``prompt_format`` for ``tokenizer`` (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        prompt_format: str = "raw",
        system_prompt: str | None = None,
        messages_key: str = "messages",
    ) -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise PromptFormatError(
                f"data.prompt_format={prompt_format!r}: use one of {list(PROMPT_FORMATS)}"
            )
        if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise PromptFormatError(
                f"data.prompt_format: chat needs a tokenizer with a chat template, and "
                f"{getattr(tokenizer, 'name_or_path', '') or 'this tokenizer'} has none; use "
                "data.prompt_format: raw, or a model folder whose tokenizer files hold one "
                "(chat_template.jinja or tokenizer_config.json's chat_template)"
            )
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.system_prompt = system_prompt
        self.messages_key = messages_key

    def messages(self, item: PromptItem) -> list[dict[str, str]]:
        """The conversation ``chat`` renders for ``item``."""
        stored = item.metadata.get(self.messages_key)
        if stored is not None:
            try:
                conversation = list(check_messages(stored))
            except ValueError as exc:
                raise PromptFormatError(
                    f"prompt {item.prompt_id}: field {self.messages_key!r} (data.messages_key) "
                    f"{exc}"
                ) from exc
        else:
            conversation = [{"role": "user", "content": item.prompt}]
        if self.system_prompt is not None and conversation[0]["role"] != "system":
            conversation.insert(0, {"role": "system", "content": self.system_prompt})
        return conversation

    def text(self, item: PromptItem) -> str:
        """The text the model is given for ``item``."""
        if self.prompt_format == "raw":
            return item.prompt
        return self.tokenizer.apply_chat_template(
            self.messages(item), tokenize=False, add_generation_prompt=True
        )


def chat_template_problem(model_name: str, tokenizer_name: str | None = None) -> str | None:
    """Why ``data.prompt_format: chat`` cannot work with this model's tokenizer, '' when it
    cannot be told here (the folder does not exist on this machine), None when it can.

    A tiny preset is checked from its definition (nothing is written); a local folder by
    loading its tokenizer.
    """
    from tandemrl.models.tiny import TINY_PRESETS, TINY_SCHEME

    source = tokenizer_name or model_name
    dotpath = "policy.tokenizer.name" if tokenizer_name else "policy.model_name"
    if source.startswith(TINY_SCHEME):
        preset = TINY_PRESETS.get(source.removeprefix(TINY_SCHEME))
        if preset is None or preset.chat is not None:
            return None  # an unknown preset is reported where the model is resolved
        chat_presets = sorted(
            TINY_SCHEME + name for name, entry in TINY_PRESETS.items() if entry.chat is not None
        )
        return (
            f"data.prompt_format: chat needs a tokenizer with a chat template, and {dotpath}="
            f"{source!r} is a raw-text task preset without one; use data.prompt_format: raw or "
            f"a chat preset ({', '.join(chat_presets)})"
        )
    from pathlib import Path

    folder = Path(source).expanduser()
    if not folder.is_dir():
        return ""
    from tandemrl.models import load_tokenizer

    try:
        tokenizer = load_tokenizer(folder)
    except Exception as exc:  # a broken folder: report it as the problem it is
        return f"{dotpath}={source!r}: the tokenizer does not load ({exc})"
    if getattr(tokenizer, "chat_template", None):
        return None
    return (
        f"data.prompt_format: chat needs a tokenizer with a chat template, and the tokenizer of "
        f"{dotpath}={source!r} has none; use data.prompt_format: raw, or add the model's "
        "chat_template.jinja to the folder"
    )
