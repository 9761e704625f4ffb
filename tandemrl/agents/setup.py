"""Build a run's ``AgentRollouts`` from the config: the service, its limits, the client kind.

``make_agent_rollouts`` is what ``build_controller`` calls on an agent run (``env.name:
agent``); everything it needs comes in as arguments (the agent, the tokenizer whose chat
template renders requests, the generation pool, the run's stop ids), so tests build the same
thing over the fake engine.
"""

from __future__ import annotations

from typing import Any

from tandemrl.agents.api import Agent
from tandemrl.agents.episodes import EpisodeRegistry
from tandemrl.agents.runner import AgentRollouts
from tandemrl.agents.server import PolicyEndpoint
from tandemrl.agents.service import (
    PolicyService,
    ServiceSettings,
    single_token_stop,
    tokenizer_chat_renderer,
)
from tandemrl.agents.workers import AgentWorkerPool
from tandemrl.codec import TextCodec
from tandemrl.config.models import MasterConfig
from tandemrl.rollout.generation_pool import GenerationPool

# Endpoint hosts only this node can reach: agent workers are then placed on the controller's.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def uses_http(cfg: MasterConfig) -> bool:
    """Whether agents talk to the policy over HTTP (``env.agent.client``)."""
    client = cfg.env.agent.client
    if client == "auto":
        return cfg.policy.generation.http_server.enabled
    return client == "http"


def service_settings(cfg: MasterConfig, *, stop_token_ids: tuple[int, ...]) -> ServiceSettings:
    generation, agent = cfg.policy.generation, cfg.env.agent
    return ServiceSettings(
        served_model_name=generation.http_server.served_model_name,
        temperature=generation.temperature,
        top_p=generation.top_p,
        stop_token_ids=stop_token_ids,
        max_tokens_per_turn=agent.max_tokens_per_turn or generation.max_new_tokens,
        max_total_tokens=cfg.policy.max_total_sequence_length,
        max_turns=agent.max_turns,
        max_tokens_per_episode=agent.max_tokens_per_episode,
        call_timeout_s=agent.call_timeout_s,
        allow_sampling_overrides=generation.http_server.allow_sampling_overrides,
        seed=cfg.algorithm.seed,
    )


def make_agent_rollouts(
    cfg: MasterConfig,
    *,
    agent: Agent,
    tokenizer: Any,
    codec: TextCodec,
    pool: GenerationPool,
    stop_token_ids: tuple[int, ...],
) -> AgentRollouts:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "env.name: agent needs the policy's tokenizer with a chat template (the endpoint "
            "renders chat requests with it); the tokenizer of policy.model_name / "
            "policy.tokenizer.name has none"
        )
    service = PolicyService(
        pool,
        registry=EpisodeRegistry(),
        settings=service_settings(cfg, stop_token_ids=stop_token_ids),
        render_chat=tokenizer_chat_renderer(tokenizer, codec.encode),
        encode=codec.encode,
        decode=codec.decode,
        token_text=lambda token_id: tokenizer.decode([token_id]),
        stop_string_ids=single_token_stop(tokenizer),
    )
    endpoint = None
    if uses_http(cfg):
        server = cfg.policy.generation.http_server
        endpoint = PolicyEndpoint(
            service,
            host=server.host,
            port=server.port,
            max_request_bytes=server.max_request_bytes,
        )
    workers = None
    if cfg.env.agent.workers:
        host = cfg.policy.generation.http_server.host
        workers = AgentWorkerPool(
            cfg.env,
            cfg.env.agent.workers,
            num_cpus=cfg.env.agent.worker_num_cpus,
            same_node=host in LOOPBACK_HOSTS,
            actor_options={"enable_task_events": cfg.cluster.ray_task_events},
        )
    return AgentRollouts(
        agent,
        service,
        episode_timeout_s=cfg.env.agent.episode_timeout_s,
        on_prefix_mismatch=cfg.token_capture.on_prefix_mismatch,
        frozen_time=pool.frozen_time,
        endpoint=endpoint,
        workers=workers,
    )
