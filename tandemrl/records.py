"""Records that cross module boundaries: prompts, generation requests and results, row metadata.

Plain dataclasses (picklable, cheap to send between Ray processes). Tensors never live here,
with one exception: a vision-language prompt's processed images travel to the engine with its
generation requests (``GenerationRequest.image_inputs``, one dict shared by a group's
requests). Rows of tensors live in the data plane, keyed by ``sample_id``.

The records the rollout builds once per prompt or per generated sequence are slotted and not
frozen: a frozen dataclass sets every field through ``object.__setattr__``, which made
building them 5-7x slower than a plain slotted class, and the controller builds tens of
thousands per second. Treat them as read-only all the same: nothing in TandemRL changes a
record after building it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(slots=True)
class PromptItem:
    """One prompt drawn from the dataloader; a prompt group is its N generations."""

    prompt_id: str  # stable across restarts: f"e{epoch}-i{index}" for dataloader prompts
    epoch: int
    index: int  # position in the epoch's order
    prompt: str
    answer: Any = None
    task_source: str | None = None
    agent_ref: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # A vision-language prompt's processor outputs besides the text (pixel_values,
    # image_grid_thw: torch tensors); None for a text prompt.
    image_inputs: dict[str, Any] | None = None


FinishReason = Literal["stop", "length", "aborted"]


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    # log p(token) under the weights that sampled it, one per generated token.
    logprobs: list[float]
    finish_reason: FinishReason
    # Weight version that produced each generated token (in-flight updates can change it
    # mid-sequence); empty when no token was generated.
    token_weight_versions: list[int] = field(default_factory=list)
    # Version the engine had when the request started.
    start_weight_version: int = 0

    @property
    def end_weight_version(self) -> int:
        if self.token_weight_versions:
            return self.token_weight_versions[-1]
        return self.start_weight_version


@dataclass(slots=True)
class AgentTurn:
    """One call an agent made to the policy: exactly what the engine saw and sampled."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # one per token of token_ids
    finish_reason: FinishReason
    start_weight_version: int = 0
    end_weight_version: int = 0


@dataclass(slots=True)
class AgentEpisode:
    """The turns of one agent run (one sibling of a prompt group), in the order they ended.

    ``ended_by``: the limit that ended the episode early (``max_turns``,
    ``max_tokens_per_episode``, ``context``), or None when the agent finished on its own.
    """

    turns: list[AgentTurn] = field(default_factory=list)
    ended_by: str | None = None

    @property
    def truncated(self) -> bool:
        """Ended by a limit, or its last turn was cut at its token budget."""
        return self.ended_by is not None or (
            bool(self.turns) and self.turns[-1].finish_reason == "length"
        )


@dataclass(slots=True)
class EnvResult:
    reward: float
    # False: the environment flags this completion as not to be trained on (sample_mask = 0).
    keep: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RowMeta:
    """Metadata of one training row (one generation of a group), kept in the replay buffer."""

    sample_id: str
    group_id: str
    sibling_index: int
    reward: float
    sample_mask: float  # 0.0 excludes the row from the loss (env flag or overlong filter)
    num_prompt_tokens: int
    num_completion_tokens: int
    truncated: bool
    start_weight_version: int
    end_weight_version: int
    # Numeric metadata of the environment's result (e.g. ``correct``), averaged per step.
    env_metrics: dict[str, float] | None = None


@dataclass(slots=True)
class TeacherRequest:
    """One completion a distillation teacher scores: it answers with its logprob of each
    completion token given everything before it (``log p(token_t | prompt, token_<t)``)."""

    request_id: str  # "{group_id}/{sibling}"
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
