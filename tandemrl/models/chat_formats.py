"""Chat formats of the tiny presets: the turn markers and the Jinja chat template of each family.

A real instruct model ships a chat template in its tokenizer files; the tiny presets of the
architecture matrix (``tiny.py``) carry one of these, in the shape of their family's, so that
``data.prompt_format: chat`` and end-of-turn stopping are tested offline exactly as they run
on a real model: the template renders with ``apply_chat_template(..., add_generation_prompt=
True)``, the markers are special tokens of the tokenizer (one id each), and the token that
ends an assistant turn is listed among the generation config's EOS ids, next to the
tokenizer's own ``<eos>`` (as Llama 3's, Qwen2.5's and Gemma's generation configs list several).

The templates were written for these presets (short, no tool calls); they are not the
families' published templates, only the same layout of markers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """A family's turn markers (special tokens) and chat template.

    ``end_of_turn``: the marker that ends an assistant turn; generation must stop there.
    ``special_tokens``: every marker the template writes, each added to the tokenizer as one
    special token.
    """

    name: str
    special_tokens: tuple[str, ...]
    end_of_turn: str
    template: str


# Qwen2 / Qwen2.5 / Qwen3: ChatML.
CHATML = ChatFormat(
    name="chatml",
    special_tokens=("<|im_start|>", "<|im_end|>"),
    end_of_turn="<|im_end|>",
    template=(
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
)

# Llama 3.x: header markers around the role, <|eot_id|> ends a turn.
LLAMA3 = ChatFormat(
    name="llama3",
    special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    end_of_turn="<|eot_id|>",
    template=(
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{{- message['content'] | trim }}{{- '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{%- endif %}"
    ),
)

# Mistral: [INST] ... [/INST]; a system prompt is folded into the first user turn; the
# assistant's turn ends with the tokenizer's own EOS.
MISTRAL = ChatFormat(
    name="mistral",
    special_tokens=("[INST]", "[/INST]"),
    end_of_turn="<eos>",
    template=(
        "{{- bos_token }}"
        "{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute="
        "'content') | list %}"
        "{%- set ns = namespace(first=true) %}"
        "{%- for message in messages if message['role'] != 'system' %}"
        "{%- if message['role'] == 'user' %}"
        "{%- if ns.first and system %}"
        "{{- '[INST] ' + system[0] + '\\n\\n' + message['content'] + ' [/INST]' }}"
        "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
        "{%- set ns.first = false %}"
        "{%- else %}{{- message['content'] + eos_token }}{%- endif %}"
        "{%- endfor %}"
    ),
)

# Gemma 2/3: <start_of_turn>role ... <end_of_turn>; the assistant's role is "model"; a system
# prompt is folded into the first user turn.
GEMMA = ChatFormat(
    name="gemma",
    special_tokens=("<start_of_turn>", "<end_of_turn>"),
    end_of_turn="<end_of_turn>",
    template=(
        "{{- bos_token }}"
        "{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute="
        "'content') | list %}"
        "{%- set ns = namespace(first=true) %}"
        "{%- for message in messages if message['role'] != 'system' %}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{%- set prefix = system[0] + '\\n\\n' if ns.first and system else '' %}"
        "{{- '<start_of_turn>' + role + '\\n' + prefix + message['content'] | trim }}"
        "{{- '<end_of_turn>\\n' }}"
        "{%- set ns.first = false %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
    ),
)

# Phi-3: <|role|> markers, <|end|> ends a turn.
PHI3 = ChatFormat(
    name="phi3",
    special_tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    end_of_turn="<|end|>",
    template=(
        "{%- for message in messages %}"
        "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
    ),
)

# Qwen2-VL / Qwen2.5-VL: ChatML whose message content may be a list of parts; an image part
# renders as the vision markers around one image placeholder, which the processor expands into
# one placeholder per merged patch of that image.
QWEN2_VL = ChatFormat(
    name="qwen2-vl",
    special_tokens=(
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
    end_of_turn="<|im_end|>",
    template=(
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
        "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
)

# The counting game's format (tiny://qwen2-counting-chat): one special token per role marker
# and one that ends a turn, nothing else, so that a two-turn episode of the counting task is
# about twenty tokens and the default tiny model learns it on a CPU in minutes.
COUNTING_CHAT = ChatFormat(
    name="counting-chat",
    special_tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"),
    end_of_turn="<|end|>",
    template=(
        "{%- for message in messages %}"
        "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
    ),
)
