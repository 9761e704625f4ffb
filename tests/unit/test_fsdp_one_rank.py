"""FSDP2 at one rank (gloo, CPU): the reduce-scatter hands back its input as its output.

``fsdp.OneRankReduceScatter`` removes the copy FSDP2 makes of every gradient at one rank. The
gradients must stay exactly those of the unsharded model (float32 on CPU: bit for bit), they
must live in the buffers it handed out (no copy was made), and torch's own path must give the
same numbers.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tandemrl.training import fsdp


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 24), nn.SiLU(), nn.Linear(24, 16)) for _ in range(3)
        )
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return self.head(hidden)


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(1, 1).flatten())


def grads_after_backward(alias: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list]:
    torch.manual_seed(0)
    model = Tiny()
    reference = copy.deepcopy(model)
    handed_out: list[torch.Tensor] = []
    allocate = fsdp.OneRankReduceScatter.allocate

    def recording(self, size, *, dtype, device):
        buffer = allocate(self, size, dtype=dtype, device=device)
        handed_out.append(buffer)
        return buffer

    monkeypatch.setattr(fsdp, "ALIAS_REDUCE_SCATTER_AT_ONE_RANK", alias)
    monkeypatch.setattr(fsdp.OneRankReduceScatter, "allocate", recording)
    fsdp.shard_model(model, model.layers, torch.device("cpu"))
    ids = torch.randint(0, 32, (4, 10), generator=torch.Generator().manual_seed(1))
    loss_of(model, ids).backward()
    loss_of(reference, ids).backward()
    for (name, param), (_, expected) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert torch.equal(param.grad.full_tensor(), expected.grad), name
    grads = {name: param.grad.to_local() for name, param in model.named_parameters()}
    return grads, handed_out


def test_one_rank_gradients_are_exact_and_not_copied(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    grads, handed_out = grads_after_backward(True, monkeypatch)
    # Two requests a unit (input, then output), and every output is the input just handed out.
    units = 4  # three layers and the root
    assert len(handed_out) == 2 * units
    for request in range(0, len(handed_out), 2):
        assert handed_out[request] is handed_out[request + 1]
    buffers = {buffer.untyped_storage().data_ptr() for buffer in handed_out}
    for name, grad in grads.items():
        assert grad.untyped_storage().data_ptr() in buffers, name


def test_torch_own_one_rank_path_gives_the_same_gradients(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    grads, handed_out = grads_after_backward(False, monkeypatch)
    assert handed_out == []  # torch's own reduce-scatter ran
    assert grads  # compared with the unsharded model's inside
