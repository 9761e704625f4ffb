"""Where a PolicyWorker train step spends its time on the GPU (one-off diagnosis for MFU).

Times one micro-batch's pieces (forward with / without the padding mask, the fp32
logprob head, backward) and prints the profiler's top kernels of a whole train step.

    python benchmarks/gpu_train_profile.py --out runs/gpu_profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import build_model_folder
from gpu_grpo import LongTail, grpo_config, make_train_batch

from tandemrl.training.policy_worker import PolicyWorker, sequence_logprobs


def timed(fn, repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "gpu_models")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_profile"))
    args = parser.parse_args()
    folder = build_model_folder("0.5b", args.models / "qwen2-0.5b", device="cuda")
    bench_args = argparse.Namespace(
        prompts_per_step=16, group_size=8, micro_batch=16, length_cap=128
    )
    cfg = grpo_config(
        folder,
        bench_args,
        ["policy.train_micro_batch_size=16", "policy.max_total_sequence_length=1024"],
    )
    worker = PolicyWorker(cfg.policy, cfg.loss_fn, model_path=folder)
    model = worker.model
    tail = LongTail(median=512, sigma=0.6, minimum=64, cap=1024)
    lengths = [tail.length(f"t{i}") for i in range(64)]
    batch = make_train_batch(lengths, model.config.vocab_size, seed=1)
    ids = torch.randint(3, model.config.vocab_size, (16, 1024), device="cuda")
    mask = torch.ones_like(ids)
    mask[8:, 700:] = 0  # right padding in half the rows
    result: dict[str, float] = {}

    def forward(with_mask: bool):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, attention_mask=mask if with_mask else None).logits

    with torch.no_grad():
        result["fwd_masked_s"] = timed(lambda: forward(True))
        result["fwd_unmasked_s"] = timed(lambda: forward(False))
        logits = forward(False)
        result["logprob_head_s"] = timed(lambda: sequence_logprobs(logits, ids, 1.0))
        logits = None

    def fwd_bwd(with_mask: bool, head: bool) -> None:
        logits = forward(with_mask)
        if head:
            logprobs, _ = sequence_logprobs(logits, ids, 1.0)
            loss = logprobs.mean()
        else:
            loss = logits[:, -1].float().mean()
        loss.backward()

    model.train()
    result["fwd_bwd_masked_head_s"] = timed(lambda: fwd_bwd(True, True))
    result["fwd_bwd_unmasked_head_s"] = timed(lambda: fwd_bwd(False, True))
    result["fwd_bwd_unmasked_nohead_s"] = timed(lambda: fwd_bwd(False, False))
    result["optimizer_step_s"] = timed(lambda: worker.optimizer.step())
    worker.optimizer.zero_grad(set_to_none=True)
    flops = 6 * sum(p.numel() for p in model.parameters()) * ids.numel()
    result["mfu_fwd_bwd_unmasked_nohead_at_765"] = (
        flops / result["fwd_bwd_unmasked_nohead_s"] / 765e12
    )

    async def step() -> None:
        await worker.begin_train_step()
        await worker.train_microbatches(batch, step_num_sequences=len(lengths))
        await worker.finish_train_step()

    asyncio.run(step())
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as profiler:
        asyncio.run(step())
        torch.cuda.synchronize()
    table = profiler.key_averages().table(sort_by="self_device_time_total", row_limit=25)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text(table)
    print(table[-6000:])
    print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
