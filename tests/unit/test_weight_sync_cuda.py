"""Flat-buffer weight sync: layout, packing, and the IPC / NCCL protocols, run on CPU.

On CPU the IPC handle is shared memory and the process group uses gloo, so these tests run
the same code as the GPU transports across real processes; only the CUDA calls differ. The
synchronisers' failure handling (dead workers, hung peers) is also driven with in-process
fakes, where each outcome can be forced.
"""

from __future__ import annotations

import asyncio
import multiprocessing.connection
from typing import Any

import pytest
import torch
from ray.exceptions import ActorDiedError
from transformers import AutoModelForCausalLM, Qwen2Config

from tandemrl.controller import weight_sync
from tandemrl.controller.weight_sync import CudaIpcWeightSync, DeviceWeightSync, NcclWeightSync
from tandemrl.rollout.generation_pool import GenerationPool, NoGenerationWorkers
from tandemrl.transport.ipc import IpcBuffer
from tandemrl.transport.layout import ALIGN_ELEMENTS, WeightLayout, WeightSyncError
from tandemrl.transport.process_group import WeightGroupAddress, leave_process_group
from tandemrl.transport.receiver import WeightReceiverHost
from tandemrl.transport.sender import FlatWeightSender

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


class _ReceiverHost(WeightReceiverHost):
    """A generation process's host: a bf16 model standing in for the engine."""

    def __init__(self) -> None:
        self.engine = _ModelLoader(_tiny_model(seed=7).to(torch.bfloat16))
        self.engine.device = torch.device("cpu")

    async def update_weights(self, version: int, weights: Any) -> None:
        await self.engine.update_weights(version, weights)

    async def snapshot(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        state = {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}
        return list(self.engine.versions), state


def _receiver_child(conn: multiprocessing.connection.Connection) -> None:
    """A generation process: runs each (method, args, kwargs) on its host, one at a time."""
    torch.set_num_threads(1)
    host = _ReceiverHost()
    while True:
        name, args, kwargs = conn.recv()
        if name == "stop":
            leave_process_group()
            conn.send((True, "stopped"))
            return
        try:
            conn.send((True, asyncio.run(getattr(host, name)(*args, **kwargs))))
        except Exception as exc:
            conn.send((False, repr(exc)))


class _ChildEngine:
    """The controller-side handle of ``_receiver_child``; a dead child raises what a dead
    Ray actor raises, so the pool takes it out of rotation."""

    def __init__(self) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_receiver_child, args=(child_conn,), daemon=True)
        self.process.start()
        self.calls: list[str] = []

    def _round_trip(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            self.conn.send((name, args, kwargs))
            if not self.conn.poll(120):
                raise TimeoutError(f"child gave no answer to {name!r}")
            ok, value = self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
            raise ActorDiedError() from exc
        if not ok:
            raise RuntimeError(f"{name} failed in the child: {value}")
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return await asyncio.to_thread(self._round_trip, name, args, kwargs)

        return call

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=30)

    def stop(self) -> None:
        if self.process.is_alive():
            self._round_trip("stop", (), {})
        self.process.join(timeout=30)


async def _held(child: _ChildEngine) -> tuple[list[int], dict[str, torch.Tensor]]:
    return await child.snapshot()


def test_ipc_sync_maps_the_buffer_once_and_sees_every_later_update() -> None:
    trainer = _tiny_model(0)
    child = _ChildEngine()
    try:
        # The trainer's sender starts in float32; the first sync re-creates it in the
        # engine's dtype (bf16), which is what the child then holds.
        sync = CudaIpcWeightSync(FlatWeightSender(trainer, torch.float32), [child])
        asyncio.run(sync.sync(1))
        versions, state = asyncio.run(_held(child))
        assert versions == [1] and sync.layout is not None and sync.layout.dtype == "bfloat16"
        _assert_state_equal(state, _expected(trainer, torch.bfloat16))
        _perturb(trainer, seed=3)
        asyncio.run(sync.sync(2))
        # The handle went over once; the child read version 2 through the same mapping.
        assert child.calls.count("attach_weight_buffer") == 1
        versions, state = asyncio.run(_held(child))
        assert versions == [1, 2]
        _assert_state_equal(state, _expected(trainer, torch.bfloat16))
    finally:
        child.stop()


def test_ipc_buffer_refuses_a_worker_on_another_device() -> None:
    buffer = IpcBuffer.export(torch.zeros(4))
    assert buffer.open(torch.device("cpu")).shape == (4,)
    elsewhere = IpcBuffer(buffer.handle, gpu_uuid="GPU-0000")
    with pytest.raises(WeightSyncError, match=r"one GPU.*weight_sync: nccl"):
        elsewhere.open(torch.device("cpu"))


def test_broadcast_over_gloo_delivers_every_version_survives_a_death_and_times_out() -> None:
    trainer = _tiny_model(0)
    children = [_ChildEngine(), _ChildEngine()]
    pool = GenerationPool(children)
    sync = NcclWeightSync(FlatWeightSender(trainer, torch.bfloat16), pool, timeout_s=20)
    try:
        asyncio.run(sync.sync(1))
        assert sync.members == (0, 1) and sync.groups_formed == 1
        for child in children:
            versions, state = asyncio.run(_held(child))
            assert versions == [1]
            _assert_state_equal(state, _expected(trainer, torch.bfloat16))
        _perturb(trainer, seed=4)
        asyncio.run(sync.sync(2))
        assert sync.groups_formed == 1  # the group is kept between syncs
        # Worker 0 dies between syncs: the next sync notices (its broadcast fails or its call
        # raises), takes it out of rotation and re-forms the group with the survivor.
        children[0].kill()
        _perturb(trainer, seed=5)
        asyncio.run(sync.sync(3))
        assert pool.live_indices == (1,) and pool.dead_workers == [0]
        assert sync.members == (1,) and sync.groups_formed == 2
        versions, state = asyncio.run(_held(children[1]))
        assert versions[-1] == 3
        _assert_state_equal(state, _expected(trainer, torch.bfloat16))
        # A broadcast nobody receives ends at the deadline, with the setting named.
        with pytest.raises(TimeoutError, match="weight_sync_timeout_s"):
            asyncio.run(sync.trainer.broadcast_weights(0.5))
        children[1].kill()
        with pytest.raises(NoGenerationWorkers):
            asyncio.run(sync.sync(4))
    finally:
        for child in children:
            child.stop()
        leave_process_group()


# ---------------------------------------------------------------------- failure handling, fakes


class _FakeTrainer:
    """Trainer host whose group calls only record what happened."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "create_weight_sender":
                return WeightLayout.from_state_dict({"w": torch.zeros(2)}, torch.float32)
            if name == "open_weight_group":
                return WeightGroupAddress("h", 1, "gloo", kwargs["world_size"], 1)
            return None

        return call


class _FakeEngine:
    def __init__(self, *, dies_on: str | None = None, hangs_on: str | None = None) -> None:
        self.dies_on = dies_on
        self.hangs_on = hangs_on
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == self.dies_on:
                raise ActorDiedError()
            if name == self.hangs_on:
                await asyncio.Event().wait()
            return "float32" if name == "weight_sync_dtype" else None

        return call


def test_a_worker_dying_mid_broadcast_is_dropped_and_the_group_re_formed() -> None:
    trainer = _FakeTrainer()
    engines = [_FakeEngine(dies_on="receive_weight_broadcast"), _FakeEngine(), _FakeEngine()]
    pool = GenerationPool(engines)
    sync = NcclWeightSync(trainer, pool, timeout_s=1)
    asyncio.run(sync.sync(1))
    assert pool.dead_workers == [0]
    assert sync.members == (1, 2) and sync.groups_formed == 2
    # formed, broadcast (one death), left, formed again, broadcast
    assert trainer.calls.count("join_weight_group_as_sender") == 2
    assert trainer.calls.count("broadcast_weights") == 2
    assert engines[1].calls.count("receive_weight_broadcast") == 2
    assert engines[1].calls.count("leave_weight_group") == 1


def test_a_hung_worker_ends_the_sync_with_an_error_naming_the_setting(monkeypatch) -> None:
    monkeypatch.setattr(weight_sync, "CONTROLLER_SLACK_S", 0.05)
    sync = NcclWeightSync(_FakeTrainer(), [_FakeEngine(hangs_on="receive_weight_broadcast")])
    sync.timeout_s = 0.05
    with pytest.raises(WeightSyncError, match=r"broadcast gave no answer.*weight_sync_timeout_s"):
        asyncio.run(sync.sync(1))
    ipc = CudaIpcWeightSync(_FakeTrainer(), [_FakeEngine(hangs_on="load_weight_buffer")])
    ipc.timeout_s = 0.05
    with pytest.raises(WeightSyncError, match="CUDA IPC: loading gave no answer"):
        asyncio.run(ipc.sync(1))


def test_ipc_sync_skips_a_dead_worker_like_the_object_store_path() -> None:
    engines = [_FakeEngine(), _FakeEngine(dies_on="load_weight_buffer")]
    pool = GenerationPool(engines)
    sync = CudaIpcWeightSync(_FakeTrainer(), pool)
    asyncio.run(sync.sync(1))
    assert pool.live_indices == (0,)
    asyncio.run(sync.sync(2))
    assert engines[0].calls.count("attach_weight_buffer") == 1
    assert engines[0].calls.count("load_weight_buffer") == 2
