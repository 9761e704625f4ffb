"""SM partitions (CUDA green contexts): the driver struct's layout, refusals, and on CUDA the
two shares' disjoint SMs, the trainer's executor on its share, and an engine decoding on its."""

from __future__ import annotations

import asyncio
import ctypes
from pathlib import Path

import pytest
import torch

from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.models import load_causal_lm, resolve_model_path
from tandemrl.records import GenerationRequest
from tandemrl.sm_partition import SmPartitionError, _DevResource, sms_used, split_sms
from tandemrl.training.worker_common import SerialExecutor

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_device_resource_matches_the_driver_layout() -> None:
    """cuda.h's CUdevResource (12.x: type, 92 bytes, a 48-byte union; 13.x: a 40-byte union
    and a pointer): 144 bytes either way, the SM count first in the union at byte 96. Arrays
    of it are written by the driver at that stride."""
    assert ctypes.sizeof(_DevResource) == 144
    assert _DevResource.sm_count.offset == 96


def test_split_refuses_a_cpu_device() -> None:
    with pytest.raises(SmPartitionError, match="need a CUDA device, got cpu"):
        split_sms(torch.device("cpu"), 8)


def _on_share(share: object, fn: object) -> object:
    executor = SerialExecutor(sm_share=share)  # type: ignore[arg-type]
    return asyncio.run(executor.run(fn))  # type: ignore[arg-type]


@cuda_only
def test_shares_run_on_disjoint_sms_and_the_executor_runs_on_its_share() -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(SmPartitionError, match=f"between 1 and {total - 1}"):
        split_sms(torch.device("cuda"), total)
    engine, trainer = split_sms(torch.device("cuda"), 16)
    assert engine.sm_count >= 16 and engine.sm_count + trainer.sm_count == total
    engine_sms = _on_share(engine, lambda: sms_used(4096))
    trainer_sms = _on_share(trainer, lambda: sms_used(4096))
    assert len(engine_sms) == engine.sm_count and len(trainer_sms) == trainer.sm_count
    assert not engine_sms & trainer_sms
    assert len(sms_used(4096)) == total  # the default stream: every SM

    # The executor's calls queue on the share's stream and finish before they return.
    x = torch.randn(512, 512, device="cuda")

    def product() -> tuple[torch.cuda.Stream, torch.Tensor]:
        return torch.cuda.current_stream(), x @ x

    stream, result = _on_share(trainer, product)  # type: ignore[misc]
    assert stream == trainer.stream
    torch.testing.assert_close(result, x @ x)


@cuda_only
def test_engine_on_a_share_decodes_the_tokens_of_the_whole_gpu(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = resolve_model_path("tiny://qwen2-counting", tmp_path_factory.mktemp("cache"))
    folder: Path = tmp_path_factory.mktemp("model")
    load_causal_lm(path, device="cpu").save_pretrained(folder)
    engine_share, _ = split_sms(torch.device("cuda"), 16)
    requests = [
        GenerationRequest(f"r{i}", p, 16, temperature=0.0)
        for i, p in enumerate([[5, 6, 7, 14], [9, 14], [4]])
    ]

    async def run(share: object) -> list[list[int]]:
        engine = TorchGenerationEngine(
            folder,
            device="cuda",
            dtype="float32",
            cuda_graphs="on",
            eos_token_ids=(),
            sm_share=share,  # type: ignore[arg-type]
        )
        stream = await engine._in_executor(torch.cuda.current_stream)
        assert stream == (engine_share.stream if share is not None else stream)
        results = await engine.generate(requests)
        assert engine.stats.graph_captures > 0
        await engine.shutdown()
        return [result.token_ids for result in results]

    assert asyncio.run(run(engine_share)) == asyncio.run(run(None))
