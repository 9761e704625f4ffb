"""Generation backends: the contract (``base``), the in-process torch engine, vLLM, fakes.

``create_generation_backend`` builds the in-process engine ``policy.generation.backend`` names;
heavy or optional backends are imported only when chosen. Ray workers wrap the same engines
(``tandemrl.generation.worker``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandemrl.generation.base import GenerationBackend, GenerationError

if TYPE_CHECKING:  # the config package (pydantic) stays out of light worker processes
    from tandemrl.config.models import PolicyConfig

__all__ = ["GenerationBackend", "GenerationError", "create_generation_backend", "engine_options"]


def engine_options(
    cfg: PolicyConfig,
    *,
    recompute_kv_cache_after_weight_updates: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """``TorchGenerationEngine`` keyword arguments from ``policy.*`` (also for Ray workers)."""
    return {
        "device": cfg.device,
        "dtype": cfg.precision,
        "max_batch_size": cfg.generation.max_batch_size,
        "cuda_graphs": cfg.generation.torch.cuda_graphs,
        "compile_step": cfg.generation.torch.compile,
        "max_seq_len": cfg.generation.torch.max_seq_len,
        "kv_cache_memory_fraction": cfg.generation.torch.kv_cache_memory_fraction,
        "admission_batch": cfg.generation.torch.admission_batch,
        "steps_per_launch": cfg.generation.torch.steps_per_launch,
        "free_cache_on_sleep": cfg.generation.colocated.free_cache_on_sleep,
        "recompute_kv_cache_after_weight_updates": recompute_kv_cache_after_weight_updates,
        # policy.generation.stop_token_ids travel on each request; the model's EOS (read from
        # the model folder) always stops as well.
        "seed": seed,
    }


def create_generation_backend(
    cfg: PolicyConfig,
    model_path: str | Path,
    *,
    recompute_kv_cache_after_weight_updates: bool = False,
    seed: int = 0,
) -> GenerationBackend:
    """An in-process engine for ``policy.generation.backend`` serving ``model_path``.

    ``model_path`` is the resolved folder (``tandemrl.models.resolve_model_path``);
    ``recompute_kv_cache_after_weight_updates`` comes from ``async_rl.*``.
    """
    backend = cfg.generation.backend
    if backend == "torch":
        from tandemrl.generation.torch_engine import TorchGenerationEngine

        return TorchGenerationEngine(
            model_path,
            **engine_options(
                cfg,
                recompute_kv_cache_after_weight_updates=recompute_kv_cache_after_weight_updates,
                seed=seed,
            ),
        )
    if backend == "vllm":
        from tandemrl.generation.vllm_engine import VllmGenerationEngine

        return VllmGenerationEngine(
            cfg,
            model_path,
            recompute_kv_cache_after_weight_updates=recompute_kv_cache_after_weight_updates,
            seed=seed,
        )
    if backend == "fake":
        from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel

        return FakeGenerationBackend(
            latency=LatencyModel.from_config(cfg.generation.fake_latency),
            seed=seed,
            completion_tokens=cfg.generation.max_new_tokens,
        )
    raise ValueError(
        f"policy.generation.backend={backend!r} has no in-process engine; "
        "use 'torch', 'vllm' or 'fake'"
    )
