"""The ownership ledger: every prompt group that was dispatched but has not committed yet.

A group enters the ledger when its buffer slot is reserved and leaves it when it commits (or
is dropped). Together with the dataloader position, the replay buffer and the consumed count,
it accounts for every prompt exactly once: drawn → in the ledger → in the buffer → trained.

For each group the ledger stores the recovery granularity resolved when the group opened
(``agent_granularity_overrides[agent_ref]``, where an agent run's rows default to
``env.target`` as their agent_ref, wins over
``task_source_granularity_overrides[task_source]``, which wins over ``default_granularity``),
so a restart with a changed config never reinterprets an existing group. With token capture
on, finished siblings (and agent episodes, with every turn's tokens) are staged here: ``sibling`` recovery reuses them and
regenerates only unfinished siblings, ``prompt_group`` discards them and regenerates all.
A sibling becomes a training row only when its whole group has finished.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tandemrl.config.models import Granularity, RolloutRecoveryConfig
from tandemrl.records import AgentEpisode, AgentTurn, EnvResult, GenerationResult, PromptItem


@dataclass(slots=True)
class StagedSibling:
    """A finished sibling: its generation and score, or an agent's episode and result."""

    result: GenerationResult | None  # None for an agent episode (its turns are in ``episode``)
    env_result: EnvResult
    episode: AgentEpisode | None = None


@dataclass
class UnfinishedGroup:
    item: PromptItem
    group_id: str
    target_step: int | None
    start_weight: int
    granularity: Granularity
    staged: dict[int, StagedSibling] = field(default_factory=dict)
    # True once the group was carried over a restart (for metrics and tests).
    recovered: bool = False
    # On-policy distillation: each sibling's teacher logprobs, one per completion token (the
    # teachers' rollout-pump stage sets them just before the commit; None until then).
    teacher_logprobs: list[list[float]] | None = None
    # Teacher passes this process ran for the group (the run journal records it at commit).
    teacher_passes: int = 0
    # A vision-language prompt's processed images (models.vision), made when the group's
    # prompt is encoded; never saved (a restart encodes the prompt's image again).
    image_inputs: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def discard_staged(self) -> None:
        self.staged.clear()
        self.teacher_logprobs = None


def resolve_granularity(
    item: PromptItem, cfg: RolloutRecoveryConfig, *, default_agent_ref: str | None = None
) -> Granularity:
    """The group's recovery granularity. ``default_agent_ref``: the agent a row without an
    ``agent_ref`` of its own runs (``env.target`` on an agent run)."""
    agent_ref = item.agent_ref if item.agent_ref is not None else default_agent_ref
    if agent_ref is not None and agent_ref in cfg.agent_granularity_overrides:
        return cfg.agent_granularity_overrides[agent_ref]
    if item.task_source is not None and item.task_source in cfg.task_source_granularity_overrides:
        return cfg.task_source_granularity_overrides[item.task_source]
    return cfg.default_granularity


_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationResult))
_ENV_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(EnvResult))
_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(PromptItem))
_TURN_FIELDS = tuple(f.name for f in dataclasses.fields(AgentTurn))


def staged_entry(sibling: StagedSibling) -> dict[str, Any]:
    # Shallow copies of the two flat records (``dataclasses.asdict`` deep-copies every token
    # list: the commit log calls this for every sibling it writes). Nobody mutates a staged
    # result, so sharing its lists until they are serialized is safe.
    result, env_result, episode = sibling.result, sibling.env_result, sibling.episode
    entry: dict[str, Any] = {
        "result": None
        if result is None
        else {name: getattr(result, name) for name in _RESULT_FIELDS},
        "env_result": {name: getattr(env_result, name) for name in _ENV_RESULT_FIELDS},
    }
    if episode is not None:
        entry["episode"] = {
            "turns": [
                {name: getattr(turn, name) for name in _TURN_FIELDS} for turn in episode.turns
            ],
            "ended_by": episode.ended_by,
        }
    return entry


def staged_from_entry(value: dict[str, Any]) -> StagedSibling:
    """The inverse of ``staged_entry``; raises KeyError/TypeError/ValueError on a bad entry."""
    raw_episode = value.get("episode")
    episode = None
    if raw_episode is not None:
        episode = AgentEpisode(
            turns=[AgentTurn(**turn) for turn in raw_episode["turns"]],
            ended_by=raw_episode["ended_by"],
        )
    raw_result = value["result"]
    if raw_result is None and episode is None:
        raise ValueError("a staged sibling holds neither a generation result nor an episode")
    return StagedSibling(
        result=None if raw_result is None else GenerationResult(**raw_result),
        env_result=EnvResult(**value["env_result"]),
        episode=episode,
    )


def group_entry(group: UnfinishedGroup, *, with_staged: bool) -> dict[str, Any]:
    """A group as the saved ledger (and the commit log) stores it; plain JSON-able values."""
    staged = {}
    if with_staged:
        staged = {str(index): staged_entry(sibling) for index, sibling in group.staged.items()}
    entry: dict[str, Any] = {
        "item": {name: getattr(group.item, name) for name in _ITEM_FIELDS},
        "group_id": group.group_id,
        "target_step": group.target_step,
        "start_weight": group.start_weight,
        "granularity": group.granularity,
        "staged": staged,
    }
    if with_staged and group.teacher_logprobs is not None:
        # The commit log's record of a committed group: replay rebuilds its rows with them,
        # so no teacher scores a committed group twice.
        entry["teacher_logprobs"] = group.teacher_logprobs
    return entry


class OwnershipLedger:
    def __init__(
        self,
        cfg: RolloutRecoveryConfig,
        *,
        token_capture: bool,
        default_agent_ref: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.token_capture = token_capture
        # Agent runs: env.target, the agent_ref of rows that name none (for the overrides).
        self.default_agent_ref = default_agent_ref
        self._groups: dict[str, UnfinishedGroup] = {}

    def open(
        self, item: PromptItem, *, group_id: str, target_step: int | None, start_weight: int
    ) -> UnfinishedGroup:
        if group_id in self._groups:
            raise KeyError(f"prompt group {group_id} is already in the ownership ledger")
        # Positional, in field order: this runs once per dispatched prompt group.
        granularity = resolve_granularity(item, self.cfg, default_agent_ref=self.default_agent_ref)
        group = UnfinishedGroup(item, group_id, target_step, start_weight, granularity)
        self._groups[group_id] = group
        return group

    def adopt(self, group: UnfinishedGroup) -> None:
        """Re-register a group restored from a checkpoint (its policy is kept as stored)."""
        if group.group_id in self._groups:
            raise KeyError(f"prompt group {group.group_id} is already in the ownership ledger")
        self._groups[group.group_id] = group

    def get(self, group_id: str) -> UnfinishedGroup:
        return self._groups[group_id]

    def close(self, group_id: str) -> None:
        self._groups.pop(group_id, None)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def unfinished(self) -> list[UnfinishedGroup]:
        return list(self._groups.values())

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state; staged siblings are kept only with token capture on."""
        groups = [
            group_entry(group, with_staged=self.token_capture) for group in self._groups.values()
        ]
        return {"token_capture": self.token_capture, "groups": groups}

    @staticmethod
    def groups_from_state(state: dict[str, Any]) -> list[UnfinishedGroup]:
        """Parse a saved ledger; raises ValueError naming the broken field."""
        groups: list[UnfinishedGroup] = []
        try:
            for raw in state["groups"]:
                granularity = raw["granularity"]
                if granularity not in ("sibling", "prompt_group"):
                    raise ValueError(f"granularity {granularity!r} of group {raw['group_id']}")
                staged = {
                    int(index): staged_from_entry(value) for index, value in raw["staged"].items()
                }
                groups.append(
                    UnfinishedGroup(
                        item=PromptItem(**raw["item"]),
                        group_id=str(raw["group_id"]),
                        target_step=raw["target_step"],
                        start_weight=int(raw["start_weight"]),
                        granularity=granularity,
                        staged=staged,
                        recovered=True,
                        teacher_logprobs=raw.get("teacher_logprobs"),
                    )
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"malformed ownership ledger entry: missing or bad field {exc}"
            ) from exc
        return groups
