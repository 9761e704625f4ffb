"""FlatWeights: one flat buffer round-trips a state dict (tied weights once, int buffers)."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from tandemrl.transport.object_store import FlatWeights


def test_flat_weights_round_trip_keeps_ties_and_integer_buffers() -> None:
    embed = torch.randn(7, 3)
    state = {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: the same storage under two names
        "layer.weight": torch.randn(3, 3, dtype=torch.float64),
        "layer.bias": torch.randn(3),
        "steps": torch.tensor([4, 5], dtype=torch.int64),
    }
    packed = FlatWeights.pack(state)
    assert packed.buffer.dtype == np.float32
    assert packed.buffer.size == 7 * 3 + 9 + 3  # the tied matrix is stored once
    # Through pickle protocol 5, as Ray sends it, and with a read-only buffer as Ray maps it.
    received = pickle.loads(pickle.dumps(packed, protocol=5))
    received.buffer.setflags(write=False)
    restored = received.to_state_dict()
    assert list(restored) == list(state)
    for name, value in state.items():
        assert restored[name].shape == value.shape, name
        assert torch.equal(restored[name], value.to(restored[name].dtype)), name
    assert restored["steps"].dtype == torch.int64
    # Packing copies: a later optimizer step on the source does not reach a sent payload.
    before = packed.to_state_dict()["embed.weight"].clone()
    embed.add_(1.0)
    assert torch.equal(packed.to_state_dict()["embed.weight"], before)


def test_flat_weights_load_into_a_module() -> None:
    source = torch.nn.Linear(4, 2)
    target = torch.nn.Linear(4, 2)
    target.load_state_dict(FlatWeights.pack(source.state_dict()).to_state_dict(), strict=True)
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)
