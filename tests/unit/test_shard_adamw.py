"""``ShardLocalAdamW`` takes torch's AdamW step, bit for bit, on FSDP2 shards and plain tensors.

Two copies of one model, one stepped by ``torch.optim.AdamW`` and one by ``ShardLocalAdamW``
with the same settings (fused, weight decay, amsgrad on and off) and the same gradients for
four steps: every parameter and every state tensor (step, exp_avg, exp_avg_sq, max_exp_avg_sq)
is equal with ``torch.equal``. On 2 gloo ranks the parameters are FSDP2 DTensors; the state
the sharded optimizer keeps stays DTensors (what the checkpoints key by name).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sharded_ranks import run_phases
from torch import nn

from tandemrl.training.shard_adamw import ShardLocalAdamW

STEPS = 4
SETTINGS = [
    {"lr": 1e-2, "weight_decay": 0.1, "fused": True},
    {"lr": 3e-3, "weight_decay": 0.0, "amsgrad": True, "foreach": True},
]


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def step_both(models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    """The same batch through both models, then one step each."""
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 + step)
        inputs = torch.randn(5, 6, generator=generator)
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            model(inputs).pow(2).mean().backward()
            optimizer.step()


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {"params": [local(p).detach().clone() for p in model.parameters()]}
    out["state"] = [
        {key: local(value).clone() for key, value in optimizer.state[p].items()}
        for p in model.parameters()
    ]
    out["state_is_dtensor"] = [
        isinstance(optimizer.state[p]["exp_avg"], DTensor) for p in model.parameters()
    ]
    return out


def assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for index, (a, b) in enumerate(zip(got["params"], want["params"], strict=True)):
        assert torch.equal(a, b), f"parameter {index} differs"
    for index, (a, b) in enumerate(zip(got["state"], want["state"], strict=True)):
        assert a.keys() == b.keys(), f"state {index}: {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert torch.equal(a[key], b[key]), f"state {index} {key} differs"


@pytest.mark.parametrize("settings", SETTINGS, ids=["fused_weight_decay", "amsgrad_foreach"])
def test_on_plain_tensors_it_is_torchs_adamw(settings: dict[str, Any]) -> None:
    models = [build(0), build(0)]
    optimizers = [
        torch.optim.AdamW(models[0].parameters(), **settings),
        ShardLocalAdamW(models[1].parameters(), **settings),
    ]
    step_both(models, optimizers)
    want, got = (snapshot(m, o) for m, o in zip(models, optimizers, strict=True))
    assert_equal(got, want)
    assert int(got["state"][0]["step"]) == STEPS


def _on_rank(rank: int, world: int, settings_list: list[dict[str, Any]]) -> list[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for settings in settings_list:
        models = [build(0), build(0)]
        for model in models:
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizers = [
            torch.optim.AdamW(models[0].parameters(), **settings),
            ShardLocalAdamW(models[1].parameters(), **settings),
        ]
        step_both(models, optimizers)
        out.append([snapshot(m, o) for m, o in zip(models, optimizers, strict=True)])
    return out


def test_on_fsdp2_shards_of_two_ranks_it_is_torchs_adamw() -> None:
    (ranks,) = run_phases([(2, _on_rank)], SETTINGS)
    for rank, per_settings in enumerate(ranks):
        for (want, got), settings in zip(per_settings, SETTINGS, strict=True):
            assert_equal(got, want)
            assert all(got["state_is_dtensor"]), (
                f"rank {rank} {settings}: the state is not DTensors"
            )
            assert int(got["state"][0]["step"]) == STEPS


def test_a_closure_is_refused() -> None:
    model = build(0)
    optimizer = ShardLocalAdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="no closure"):
        optimizer.step(lambda: 0.0)
