"""What counts as a credential in a config, and the config with credentials taken out.

A key names a credential when its last word is one (``hf_token``, ``wandb_api_key``,
``client_secret``, ``credentials``); matched per dotpath segment, so a credential block's
children go too. Words inside a key do not count: ``max_new_tokens``, ``token_capture``,
``stop_token_ids`` and ``tokenizer`` are rollout semantics, not secrets. A URL value with a
password (``https://user:secret@host``) keeps its host but loses the password.

The checkpoint fingerprint (``checkpoint/fingerprint.py``) and the experiment trackers
(``metrics/trackers.py``) both write config values to disk; both go through here.
"""

from __future__ import annotations

import re
from typing import Any

_CREDENTIAL = re.compile(
    r"(^|[_-])(password|passwd|secret|token|credentials?|auth|apikey|(api|access|secret|private)[_-]?key)$",
    re.IGNORECASE,
)
# scheme://user:password@host -> scheme://user:<redacted>@host (also scheme://token@host).
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")
REDACTED = "<redacted>"


def is_credential(dotpath: str) -> bool:
    return any(_CREDENTIAL.search(segment) for segment in dotpath.split("."))


def redact_url(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        user = match.group("userinfo").split(":", 1)[0]
        kept = f"{user}:{REDACTED}" if ":" in match.group("userinfo") else REDACTED
        return f"{match.group('scheme')}{kept}@"

    return _URL_USERINFO.sub(replace, text)


def redact_value(dotpath: str, value: Any) -> Any:
    if is_credential(dotpath):
        return REDACTED
    return redact_url(value) if isinstance(value, str) else value


def redact_tree(node: Any, path: str = "") -> Any:
    """A copy of a plain config tree with every credential replaced by ``<redacted>``."""
    if path and is_credential(path):
        return REDACTED
    if isinstance(node, dict):
        return {
            key: redact_tree(value, f"{path}.{key}" if path else str(key))
            for key, value in node.items()
        }
    if isinstance(node, list | tuple):
        return [redact_tree(value, f"{path}.{index}") for index, value in enumerate(node)]
    return redact_value(path, node)
