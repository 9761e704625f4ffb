"""CUDA IPC and NCCL weight sync on real GPUs (skipped without CUDA; NCCL needs two GPUs).

Imports nothing of Ray, so it also runs on the GPU machine, which has none. A spawned child
process stands in for a generation worker: it holds a bf16 model on its GPU and loads what the
trainer's buffer holds; the test compares every parameter exactly.
"""

from __future__ import annotations

import asyncio
import multiprocessing.connection
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tandemrl.controller.weight_sync import CudaIpcWeightSync, NcclWeightSync
from tandemrl.transport.ipc import IpcBuffer
from tandemrl.transport.layout import WeightSyncError
from tandemrl.transport.process_group import leave_process_group
from tandemrl.transport.receiver import WeightReceiverHost
from tandemrl.transport.sender import FlatWeightSender

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model(seed: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)


class _Engine:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.model = _model(7, device, torch.bfloat16)
        self.versions: list[int] = []


class _Host(WeightReceiverHost):
    def __init__(self, device: str) -> None:
        self.engine = _Engine(device)

    async def update_weights(self, version: int, weights: Any) -> None:
        with torch.no_grad():
            self.engine.model.load_state_dict(dict(weights), strict=True)
        self.engine.versions.append(version)

    async def snapshot(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        state = {k: v.detach().cpu() for k, v in self.engine.model.state_dict().items()}
        return list(self.engine.versions), state


def _child(conn: multiprocessing.connection.Connection, device: str) -> None:
    host = _Host(device)
    while True:
        name, args, kwargs = conn.recv()
        if name == "stop":
            leave_process_group()
            conn.send((True, None))
            return
        try:
            conn.send((True, asyncio.run(getattr(host, name)(*args, **kwargs))))
        except Exception as exc:
            conn.send((False, repr(exc)))


class _Child:
    def __init__(self, device: str) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_child, args=(child_conn, device), daemon=True)
        self.process.start()

    def _ask(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.conn.send((name, args, kwargs))
        if not self.conn.poll(120):
            raise TimeoutError(name)
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(self._ask, name, args, kwargs)

        return call

    def stop(self) -> None:
        if self.process.is_alive():
            self._ask("stop", (), {})
        self.process.join(timeout=60)


def _check(child: _Child, trainer: torch.nn.Module, version: int) -> None:
    versions, state = asyncio.run(child.snapshot())
    assert versions[-1] == version
    for name, value in trainer.state_dict().items():
        torch.testing.assert_close(
            state[name], value.detach().to(torch.bfloat16).cpu(), rtol=0, atol=0, msg=name
        )


def _perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))


def test_cuda_ipc_to_a_process_on_the_same_gpu() -> None:
    trainer = _model(0, "cuda:0", torch.float32)
    child = _Child("cuda:0")
    try:
        sync = CudaIpcWeightSync(FlatWeightSender(trainer, torch.float32), [child])
        asyncio.run(sync.sync(1))  # re-creates the sender in the engine's dtype (bf16)
        _check(child, trainer, 1)
        _perturb(trainer)
        asyncio.run(sync.sync(2))
        _check(child, trainer, 2)
    finally:
        child.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ipc_refuses_another_gpu_and_nccl_reaches_it() -> None:
    buffer = IpcBuffer.export(torch.zeros(8, device="cuda:0"))
    with pytest.raises(WeightSyncError, match="one GPU"):
        buffer.open(torch.device("cuda:1"))
    trainer = _model(0, "cuda:0", torch.float32)
    child = _Child("cuda:1")
    try:
        sync = NcclWeightSync(FlatWeightSender(trainer, torch.bfloat16), [child], timeout_s=60)
        asyncio.run(sync.sync(1))
        _check(child, trainer, 1)
        _perturb(trainer)
        asyncio.run(sync.sync(2))
        _check(child, trainer, 2)
        assert sync.groups_formed == 1
    finally:
        child.stop()
        leave_process_group()
