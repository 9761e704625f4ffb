"""Shared fixtures: one local Ray session for every test that needs real processes."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by the whole test session (start-up costs ~3 s)."""
    import ray

    if not ray.is_initialized():
        # Logical CPUs, not cores: actors in tests reserve 1 each; the machine has 2 cores.
        ray.init(
            num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="tandemrl-tests"
        )
    yield ray
    ray.shutdown()
