"""Episode keys and the turns they capture: pure state, no I/O, no tasks.

Every agent run (one sibling of one prompt group, one attempt) opens an ``Episode`` with a
fresh random key, the bearer token its client sends. The registry answers three questions
for the endpoint: is this key one we issued (else 401), is its episode still open (else 409,
saying why it ended), and which episode does a call belong to (the call becomes one of its
turns). An episode is open from ``open`` until the runner closes it (the agent returned,
failed, timed out, its group was dropped or aborted) or a limit ends it (``end``: max_turns,
max_tokens_per_episode, the context); either way later calls get 409.

Keys of closed episodes are remembered (the most recent ``CLOSED_KEYS_KEPT``), so that a
late call of a finished episode gets 409, not 401.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from tandemrl.records import AgentEpisode, AgentTurn

# Closed keys remembered for their 409 answer; older ones are forgotten (then 401).
CLOSED_KEYS_KEPT = 65536
KEY_PREFIX = "trl-ep-"


class UnknownEpisodeKey(LookupError):
    """No episode was ever opened with this key (HTTP 401)."""


class EpisodeClosed(LookupError):
    """The key's episode ended (HTTP 409); the message says how."""


@dataclass
class Episode:
    key: str
    group_id: str
    sibling: int
    attempt: int
    # Calls started so far (each gets its own request id and seed, in call order).
    calls: int = 0
    # Tokens generated or reserved by calls in flight (max_tokens_per_episode accounting).
    generated_tokens: int = 0
    turns: list[AgentTurn] = field(default_factory=list)
    # The limit that ended the episode (max_turns, max_tokens_per_episode, context).
    ended_by: str | None = None
    # Why it was closed by the runner (finished, failed, timed out, dropped), None while open.
    closed_as: str | None = None
    # An engine failure or call deadline the endpoint met while serving this episode: the
    # runner charges the episode as an infrastructure failure whatever the agent did with it.
    infra_failure: BaseException | None = None
    # The group's generation was aborted (stale, windowed sampler) under one of its calls.
    aborted: bool = False
    # Request ids of calls in flight (aborted on the engine when the episode closes).
    in_flight: set[str] = field(default_factory=set)

    @property
    def request_prefix(self) -> str:
        return f"{self.group_id}/{self.sibling}/a{self.attempt}"

    def end(self, limit: str) -> None:
        """A limit ended the episode: later calls are refused (409)."""
        if self.ended_by is None:
            self.ended_by = limit

    def captured(self) -> AgentEpisode:
        return AgentEpisode(turns=list(self.turns), ended_by=self.ended_by)

    def refusal(self) -> str | None:
        """Why a new call of this episode is refused, or None while it may call."""
        if self.closed_as is not None:
            return f"episode {self.request_prefix} is {self.closed_as}"
        if self.ended_by is not None:
            return (
                f"episode {self.request_prefix} ended: it reached its {self.ended_by} limit "
                f"({_LIMIT_KEYS.get(self.ended_by, self.ended_by)})"
            )
        return None


_LIMIT_KEYS = {
    "max_turns": "env.agent.max_turns",
    "max_tokens_per_episode": "env.agent.max_tokens_per_episode",
    "context": "policy.max_total_sequence_length",
}


class EpisodeRegistry:
    """Open episodes by key, plus the keys of recently closed ones."""

    def __init__(self) -> None:
        self._open: dict[str, Episode] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def open(self, group_id: str, sibling: int, attempt: int) -> Episode:
        key = KEY_PREFIX + secrets.token_urlsafe(18)
        episode = Episode(key, group_id, sibling, attempt)
        self._open[key] = episode
        return episode

    def lookup(self, key: str | None) -> Episode:
        """The open episode of ``key``; UnknownEpisodeKey / EpisodeClosed otherwise."""
        if key is not None:
            episode = self._open.get(key)
            if episode is not None:
                refusal = episode.refusal()
                if refusal is not None:
                    raise EpisodeClosed(refusal)
                return episode
            closed_as = self._closed.get(key)
            if closed_as is not None:
                raise EpisodeClosed(closed_as)
        raise UnknownEpisodeKey(
            "missing or unknown episode key: send the key of an open agent episode as the "
            "bearer token (the OpenAI client's api_key)"
        )

    def close(self, episode: Episode, closed_as: str) -> None:
        """The runner is done with ``episode``; its key answers 409 from now on."""
        episode.closed_as = closed_as
        if self._open.pop(episode.key, None) is None:
            return
        self._closed[episode.key] = f"episode {episode.request_prefix} is {closed_as}"
        while len(self._closed) > CLOSED_KEYS_KEPT:
            self._closed.popitem(last=False)
