"""Flat-buffer weight sync: layout, packing, and the IPC / NCCL protocols, run on CPU.

On CPU the IPC handle is shared memory and the process group uses gloo, so these tests run
the same code as the GPU transports across real processes; only the CUDA calls differ.
"""

from __future__ import annotations

import asyncio
import multiprocessing.connection
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from tandemrl.controller.weight_sync_cuda import (
    ALIGN_ELEMENTS,
    CudaIpcWeightSync,
    DeviceWeightSync,
    FlatWeightReceiver,
    FlatWeightSender,
    NcclWeightSync,
    WeightLayout,
    init_weight_group,
)

TIED = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def _tiny_model(seed: int) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class _ModelLoader:
    """A minimal engine: ``update_weights`` loads a state dict into its model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.versions: list[int] = []

    async def update_weights(self, version: int, weights: Any) -> None:
        with torch.no_grad():
            self.model.load_state_dict(dict(weights), strict=True)
        self.versions.append(version)


def _expected(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What an engine holds after a sync: each parameter rounded through ``dtype``."""
    return {k: v.detach().to(dtype).float() for k, v in model.state_dict().items()}


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name].float(), value, rtol=0, atol=0, msg=name)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator))


# ---------------------------------------------------------------------- layout


def test_layout_packs_tied_parameters_once_on_aligned_offsets() -> None:
    model = _tiny_model(0)
    state = model.state_dict()
    assert state[TIED].data_ptr() == state[EMBED].data_ptr()  # tied in this model
    layout = WeightLayout.from_state_dict(state, torch.bfloat16)
    assert layout.aliases == ((TIED, EMBED),)
    assert TIED not in {slot.name for slot in layout.slots}
    assert sorted(layout.names) == sorted(state)
    assert all(slot.offset % ALIGN_ELEMENTS == 0 for slot in layout.slots)
    ends = [slot.offset + slot.numel for slot in layout.slots]
    assert all(
        end <= following.offset for end, following in zip(ends[:-1], layout.slots[1:], strict=True)
    )
    assert layout.numel >= sum(p.numel() for p in model.parameters())
    assert layout.nbytes == layout.numel * 2
    views = layout.views(layout.allocate("cpu"))
    assert views[TIED].data_ptr() == views[EMBED].data_ptr()
    assert all(views[name].shape == state[name].shape for name in state)


def test_layout_refuses_integer_tensors_unknown_dtypes_and_wrong_buffers() -> None:
    with pytest.raises(ValueError, match=r"'steps' is torch\.int64"):
        WeightLayout.from_state_dict({"steps": torch.zeros(3, dtype=torch.long)}, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        WeightLayout.from_state_dict({"w": torch.zeros(3)}, torch.int8)
    layout = WeightLayout.from_state_dict({"w": torch.zeros(3)}, torch.bfloat16)
    with pytest.raises(ValueError, match="does not match the layout"):
        layout.views(torch.zeros(layout.numel, dtype=torch.float32))
    with pytest.raises(ValueError, match="does not match the layout"):
        layout.views(torch.zeros(layout.numel + 1, dtype=torch.bfloat16))


def test_sender_stage_casts_and_follows_in_place_updates() -> None:
    model = _tiny_model(0)
    sender = FlatWeightSender(model, torch.bfloat16)
    sender.stage()
    _assert_state_equal(
        {k: v.float() for k, v in sender.layout.views(sender.buffer).items()},
        _expected(model, torch.bfloat16),
    )
    _perturb(model, seed=1)  # what an optimizer step does: in-place updates
    sender.stage()
    _assert_state_equal(
        {k: v.float() for k, v in sender.layout.views(sender.buffer).items()},
        _expected(model, torch.bfloat16),
    )
    assert sender.stages == 2


def test_device_weight_sync_loads_every_engine_in_process() -> None:
    trainer, engines = _tiny_model(0), [_ModelLoader(_tiny_model(s)) for s in (1, 2)]
    sync = DeviceWeightSync(FlatWeightSender(trainer, torch.float32), engines)
    seconds = asyncio.run(sync.sync(5))
    assert seconds > 0
    for engine in engines:
        assert engine.versions == [5]
        _assert_state_equal(engine.model.state_dict(), _expected(trainer, torch.float32))


# ---------------------------------------------------------------------- across processes


def _receiver_child(conn: multiprocessing.connection.Connection) -> None:
    """A generation process: maps or receives the flat buffer, loads it into its own model."""
    torch.set_num_threads(1)
    loader = _ModelLoader(_tiny_model(seed=7))
    receiver: FlatWeightReceiver | None = None
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "attach":
            receiver = FlatWeightReceiver.from_ipc_handle(loader, message[2], message[1])
            conn.send("attached")
        elif kind == "join":
            init_weight_group(
                rank=1,
                world_size=2,
                init_method=message[1],
                backend="gloo",
                device=torch.device("cpu"),
            )
            receiver = FlatWeightReceiver.with_own_buffer(loader, message[2], "cpu")
            conn.send("joined")
        elif kind in ("load", "broadcast"):
            assert receiver is not None
            if kind == "load":
                asyncio.run(receiver.load(message[1]))
            else:
                asyncio.run(receiver.receive_broadcast(message[1]))
            state = {k: v.detach().clone() for k, v in loader.model.state_dict().items()}
            conn.send((list(loader.versions), state))
        else:
            if dist.is_initialized():
                dist.destroy_process_group()
            conn.send("stopped")
            return


class _ChildEngine:
    """The controller-side handle of ``_receiver_child`` (what a Ray actor handle would be)."""

    def __init__(self) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_receiver_child, args=(child_conn,), daemon=True)
        self.process.start()
        self.attach_calls = 0
        self.versions: list[int] = []
        self.state: dict[str, torch.Tensor] = {}

    def _round_trip(self, message: tuple[Any, ...]) -> Any:
        self.conn.send(message)
        if not self.conn.poll(120):
            raise TimeoutError(f"child gave no answer to {message[0]!r}")
        return self.conn.recv()

    async def _ask(self, *message: Any) -> Any:
        return await asyncio.to_thread(self._round_trip, message)

    async def attach_weight_buffer(self, handle: Any, layout: WeightLayout) -> None:
        self.attach_calls += 1
        assert await self._ask("attach", handle, layout) == "attached"

    async def load_weight_buffer(self, version: int) -> None:
        self.versions, self.state = await self._ask("load", version)

    async def receive_weight_broadcast(self, version: int) -> None:
        self.versions, self.state = await self._ask("broadcast", version)

    def stop(self) -> None:
        if self.process.is_alive():
            assert self._round_trip(("stop",)) == "stopped"
        self.process.join(timeout=30)


def test_ipc_sync_maps_the_buffer_once_and_sees_every_later_update() -> None:
    trainer = _tiny_model(0)
    child = _ChildEngine()
    try:
        sync = CudaIpcWeightSync(FlatWeightSender(trainer, torch.bfloat16), [child])
        asyncio.run(sync.sync(1))
        assert child.versions == [1]
        _assert_state_equal(child.state, _expected(trainer, torch.bfloat16))
        _perturb(trainer, seed=3)
        asyncio.run(sync.sync(2))
        # The handle went over once; the child read version 2 through the same mapping.
        assert child.attach_calls == 1
        assert child.versions == [1, 2]
        _assert_state_equal(child.state, _expected(trainer, torch.bfloat16))
    finally:
        child.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_broadcast_sync_over_a_gloo_group_delivers_every_version() -> None:
    trainer = _tiny_model(0)
    sender = FlatWeightSender(trainer, torch.bfloat16)
    child = _ChildEngine()
    init = f"tcp://127.0.0.1:{_free_port()}"

    async def join() -> None:
        await asyncio.gather(
            asyncio.to_thread(
                init_weight_group,
                rank=0,
                world_size=2,
                init_method=init,
                backend="gloo",
                device=torch.device("cpu"),
            ),
            child._ask("join", init, sender.layout),
        )

    try:
        asyncio.run(join())
        sync = NcclWeightSync(sender, [child], group=dist.group.WORLD)
        asyncio.run(sync.sync(1))
        _assert_state_equal(child.state, _expected(trainer, torch.bfloat16))
        _perturb(trainer, seed=4)
        asyncio.run(sync.sync(2))
        assert child.versions == [1, 2]
        _assert_state_equal(child.state, _expected(trainer, torch.bfloat16))
    finally:
        child.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
