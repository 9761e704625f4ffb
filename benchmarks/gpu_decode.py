"""Static-cache decode (tandemrl.generation.static_decode): correctness, ms/step, % of the floor.

Three measurements on a random-init Qwen2 of a real size (``gpu_common.QWEN2_SIZES``):

- ``check``: logits of the static step against the transformers forward pass on the same
  tokens (float32 on CPU: ~1e-6; bf16 on the GPU: ~1e-2, bf16 rounding).
- ``graph``: decode steps of ``rows`` busy slots at a mean context of ``context + steps/2``,
  replayed as a CUDA graph of ``--steps-per-launch`` steps, with and without
  ``torch.compile`` fusions; ms/step from CUDA events over ``steps`` steps; the floor is (weight bytes + rows x context x KV bytes per
  token) / copy bandwidth; kernels per step counted with ``torch.profiler`` on one eager step.
- ``engine``: ``TorchGenerationEngine`` end to end (admission prefill, graph replays, host
  bookkeeping): all rows admitted at once, ``steps`` sampled tokens each; tokens/s and ms per
  decode step (busy time of ``_step`` / steps, with and without the admission prefill), static
  path (one launch in flight or none; ``--steps-per-launch`` steps a launch) vs
  ``cuda_graphs="off"``.

``--attention kernel torch``: the static step's decode attention as one Triton kernel
(``decode_attention.py``, the default) or as the torch reference (two batched products around
a softmax); the graph and engine rows are measured for each. ``--sampler kernel torch``: the
sampling draw as one Triton kernel (``decode_sampler.py``) or as the torch passes.
``--step-variants``: forms of the step as ``ROPE:SPLITS[:O_SPLITS[:QKV_SPLITS[:KV_WRITE]]]``
(``static_decode.ROPE_IN_ATTENTION`` 0/1: the queries rotated inside the attention kernel;
``KV_WRITE`` 0/1: ``static_decode.KV_WRITE_IN_ATTENTION``, the new keys/values written by it;
``static_decode.DOWN_SPLITS`` / ``O_SPLITS`` / ``QKV_SPLITS``: the down / output / QKV
projection as that many partial products, 1 when left out); the graph rows are measured for each.
``--compile-modes``: ``torch.compile`` modes of the graph's compiled step (``default``,
``max-autotune-no-cudagraphs``). ``--admission-batches`` with ``--workload longtail``: the engine
over 4 x rows requests of lognormal lengths (rows join as others finish), for each
``admission_batch``. ``--profile-prefill``: the admission prefill of ``rows`` prompts alone.

    python benchmarks/gpu_decode.py --size tiny --check-only          # CPU
    python benchmarks/gpu_decode.py --size 0.5b --batches 64 256      # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import EOS_TOKEN_ID, QWEN2_SIZES, build_model_folder, write_result

from tandemrl.generation import decode_attention, decode_sampler, static_decode, torch_engine
from tandemrl.generation.static_decode import StaticDecoder, kv_bytes_per_token
from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.models import load_causal_lm
from tandemrl.records import GenerationRequest


def check(model: Any, length: int, seed: int) -> float:
    """max |static - transformers| / max |transformers| over every position's logits."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, model.config.vocab_size, (2, length), generator=generator).to(device)
    with torch.inference_mode():
        reference = model(input_ids=tokens).logits.float()
    decoder = StaticDecoder(model, slots=2, max_len=length, use_graphs=False, compile_step=False)
    worst = 0.0
    with torch.inference_mode():
        for position in range(length):
            decoder.tokens.copy_(tokens[:, position])
            decoder.positions.fill_(position)
            logits = decoder.forward(2, length).float()
            expected = reference[:, position]
            error = float((logits - expected).abs().max() / expected.abs().max())
            worst = max(worst, error if error == error else float("inf"))  # NaN: inf
    return worst


def count_kernels(decoder: StaticDecoder, rows: int, length: int) -> dict[str, Any]:
    """CUDA kernels of one eager launch (what a graph replays), by name; counts per step."""
    from torch.profiler import ProfilerActivity, profile

    saved = (decoder.tokens.clone(), decoder.positions.clone())
    with torch.inference_mode():
        decoder._decode(rows, length, False)  # warm (compilation happens outside the trace)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            decoder._decode(rows, length, False)
            torch.cuda.synchronize()
    decoder.tokens.copy_(saved[0])
    decoder.positions.copy_(saved[1])
    kernels: dict[str, list[float]] = {}
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:40]
    per_launch = decoder.steps  # one _decode is one launch of that many steps
    return {
        "kernels_per_step": sum(len(times) for times in kernels.values()) / per_launch,
        "kernel_us_per_step": sum(sum(times) for times in kernels.values()) / per_launch,
        "top": [
            {"name": name[:90], "count": len(times), "us": round(sum(times), 1)}
            for name, times in top
        ],
    }


def bench_graph(
    model: Any,
    rows: int,
    context: int,
    steps: int,
    compile_step: bool,
    bandwidth: float,
    compile_mode: str | None = None,
    per_launch: int = 1,
) -> dict[str, Any]:
    max_len = context + steps + per_launch + 8
    decoder = StaticDecoder(
        model,
        slots=rows,
        max_len=max_len,
        use_graphs=True,
        compile_step=compile_step,
        compile_mode=compile_mode,
        steps=per_launch,
    )
    decoder.cache.normal_()
    busy = list(range(rows))
    vocab = model.config.vocab_size
    decoder.set_rows(
        busy,
        tokens=torch.randint(3, vocab, (rows,)).tolist(),
        positions=[context] * rows,
        temperatures=[1.0] * rows,
        top_ps=[1.0] * rows,
    )
    started = time.perf_counter()
    length = max_len  # one graph: the attended length covers every step of the run
    key = (rows, length, False)
    with torch.inference_mode():
        decoder._capture(key)
    capture_s = time.perf_counter() - started
    graph = decoder._graphs[key]
    decoder.positions.fill_(context)
    graph.replay()
    torch.cuda.synchronize()
    decoder.positions.fill_(context)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replays = max(1, steps // per_launch)
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_s = start.elapsed_time(end) / 1e3 / (replays * per_launch)
    logprobs = decoder._launch_views(rows, (decoder.uniforms, decoder.out))[1][..., 1]
    assert bool(torch.isfinite(logprobs).all()), "non-finite logprobs"
    mean_context = context + steps / 2
    floor_s = floor_seconds(model, rows, mean_context, bandwidth)
    result = {
        "rows": rows,
        "steps_per_launch": per_launch,
        "compile": compile_step,
        "context": mean_context,
        "attended_length": length,
        "step_ms": step_s * 1e3,
        "tok_s": rows / step_s,
        "floor_ms": floor_s * 1e3,
        "floor_fraction": floor_s / step_s,
        "capture_s": capture_s,
    }
    try:
        result.update(count_kernels(decoder, rows, length))
    except Exception as exc:  # the timing above stands without the kernel count
        result["kernel_count_error"] = repr(exc)[:500]
    return result


async def bench_engine(
    folder: Path,
    rows: int,
    prompt_len: int,
    steps: int,
    cuda_graphs: str,
    pipeline: bool,
    admission_batch: int | None = None,
    workload: str = "uniform",
    bandwidth: float | None = None,
    per_launch: int = 1,
) -> dict[str, Any]:
    """``uniform``: ``rows`` requests of ``steps`` tokens, admitted at once; ``longtail``:
    4 x ``rows`` requests of lognormal lengths (median ``steps / 2``, at most ``2 x steps``).
    ``bandwidth`` (TB/s): also the steady decode step's fraction of the floor (uniform only:
    every row busy, mean context ``prompt_len + steps / 2``, as in ``bench_graph``)."""
    longest = steps if workload == "uniform" else 2 * steps
    engine = TorchGenerationEngine(
        folder,
        device="cuda",
        max_batch_size=rows,
        eos_token_ids=[EOS_TOKEN_ID],
        cuda_graphs=cuda_graphs,
        max_seq_len=prompt_len + longest + 64,
        pipeline_steps=pipeline,
        admission_batch=admission_batch,
        steps_per_launch=per_launch,
    )
    step = engine._step
    busy = [0.0]
    # (end of the step, whether it admitted): the steady decode rate is the median interval
    # between the ends of two consecutive steps that admitted nothing (no prefill, no result
    # building between them: what the floor describes).
    ends: list[tuple[float, bool]] = []

    def timed_step(admit: list[Any]) -> list[Any]:
        started = time.perf_counter()
        try:
            return step(admit)
        finally:
            now = time.perf_counter()
            busy[0] += now - started
            ends.append((now, bool(admit)))

    engine._step = timed_step  # type: ignore[method-assign]
    prefill_s = [0.0]
    if engine.static_decode:
        decoder = engine._ensure_decoder()
        prefill = decoder.prefill

        def timed_prefill(*args: Any) -> None:
            torch.cuda.synchronize()
            started = time.perf_counter()
            prefill(*args)
            torch.cuda.synchronize()
            prefill_s[0] += time.perf_counter() - started

        decoder.prefill = timed_prefill  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(rows)
    vocab = engine.vocab_size

    def requests(tag: str, count: int, new_tokens: int) -> list[GenerationRequest]:
        lengths = [new_tokens] * count
        if workload == "longtail":
            draws = torch.randn(count, generator=generator) * 0.7
            lengths = (new_tokens / 2 * draws.exp()).clamp(8, 2 * new_tokens).long().tolist()
        return [
            GenerationRequest(
                request_id=f"{tag}{row}",
                prompt_token_ids=torch.randint(
                    3, vocab, (prompt_len,), generator=generator
                ).tolist(),
                max_new_tokens=lengths[row],
                stop_token_ids=(),
            )
            for row in range(count)
        ]

    count = rows if workload == "uniform" else 4 * rows
    engine.eos_token_ids = frozenset()
    warm_started = time.perf_counter()
    await engine.generate(requests("w", count, steps))  # compiles and captures what it uses
    warm_s = time.perf_counter() - warm_started
    busy[0], prefill_s[0], steps_before = 0.0, 0.0, engine.stats.decode_steps
    ends.clear()
    wait_before = engine.stats.device_wait_s
    admissions_before = engine.stats.admissions
    started = time.perf_counter()
    results = await engine.generate(requests("r", count, steps))
    elapsed = time.perf_counter() - started
    decode_steps = engine.stats.decode_steps - steps_before
    tokens = sum(len(result.token_ids) for result in results)
    out = {
        "rows": rows,
        "cuda_graphs": cuda_graphs,
        "static": engine.static_decode,
        "pipeline": pipeline,
        "steps_per_launch": engine.steps_per_launch,
        "workload": workload,
        "admission_batch": engine.admission_batch,
        "admissions": engine.stats.admissions - admissions_before,
        "decode_steps": decode_steps,
        "mean_rows": tokens / max(decode_steps, 1),
        "tok_s": tokens / elapsed,
        "ms_per_step": 1e3 * busy[0] / max(decode_steps, 1),
        "prefill_s": prefill_s[0],
        "ms_per_step_without_prefill": 1e3 * (busy[0] - prefill_s[0]) / max(decode_steps, 1),
        "wall_ms_per_step": 1e3 * elapsed / max(decode_steps, 1),
        # One engine step is one launch of steps_per_launch decode steps.
        "steady_ms_per_step": 1e3 * steady_interval(ends) / engine.steps_per_launch,
        "device_wait_ms_per_step": 1e3
        * (engine.stats.device_wait_s - wait_before)
        / max(decode_steps, 1),
        "warmup_s": warm_s,
        "graph_captures": engine.stats.graph_captures,
    }
    if bandwidth and workload == "uniform":
        floor_ms = 1e3 * floor_seconds(engine.model, rows, prompt_len + steps / 2, bandwidth)
        out["steady_tok_s"] = rows * 1e3 / out["steady_ms_per_step"]
        out["steady_floor_fraction"] = floor_ms / out["steady_ms_per_step"]
    await engine.shutdown()
    return out


def floor_seconds(model: Any, rows: int, mean_context: float, bandwidth: float) -> float:
    """The bandwidth floor of one decode step: the weights and ``rows`` caches of
    ``mean_context`` tokens read once at ``bandwidth`` TB/s."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = rows * mean_context * kv_bytes_per_token(model)
    return (weight_bytes + kv_bytes) / (bandwidth * 1e12)


def steady_interval(ends: list[tuple[float, bool]]) -> float:
    """Median seconds between the ends of consecutive steps that both admitted nothing."""
    gaps = [
        later - earlier
        for (earlier, admitted_before), (later, admitted) in itertools.pairwise(ends)
        if not admitted_before and not admitted
    ]
    return statistics.median(gaps) if gaps else float("nan")


def profile_prefill(
    model: Any, rows: int, prompt_len: int, compile_step: bool = True
) -> dict[str, Any]:
    """The admission prefill of ``rows`` random prompts into a static decoder (compiled as the
    engine runs it): wall time (median of 3 after a warm-up) and the largest kernels of one
    traced run."""
    from torch.profiler import ProfilerActivity, profile

    decoder = StaticDecoder(
        model, slots=rows, max_len=prompt_len + 8, use_graphs=False, compile_step=compile_step
    )
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, model.config.vocab_size, (rows, prompt_len), generator=generator)
    prefixes = prompts.tolist()
    slots = list(range(rows))
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        started = time.perf_counter()
        decoder.prefill(slots, prefixes)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        decoder.prefill(slots, prefixes)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:15]
    result = {
        "rows": rows,
        "prompt_len": prompt_len,
        "prefill_ms": 1e3 * sorted(times[1:])[1],
        "kernels": sum(len(t) for t in kernels.values()),
        "kernel_ms": sum(sum(t) for t in kernels.values()) / 1e3,
        "top": [{"name": name[:90], "count": len(t), "us": round(sum(t), 1)} for name, t in top],
    }
    del decoder
    torch.cuda.empty_cache()
    return result


def attention_launch() -> tuple[int, int, int, int]:
    """``decode_attention``'s launch switches: (BLOCK_N, NUM_WARPS, NUM_STAGES, SPLITS)."""
    a = decode_attention
    return (a.BLOCK_N, a.NUM_WARPS, a.NUM_STAGES, a.SPLITS)


def set_attention_launch(shape: tuple[int, ...]) -> None:
    a = decode_attention
    a.BLOCK_N, a.NUM_WARPS, a.NUM_STAGES, a.SPLITS = shape


def set_step_variant(variant: str) -> None:
    """``ROPE:SPLITS[:O_SPLITS[:QKV_SPLITS[:KV_WRITE]]]`` (see ``--step-variants``) into the
    switches."""
    rope, splits, *rest = variant.split(":")
    static_decode.ROPE_IN_ATTENTION, static_decode.DOWN_SPLITS = rope == "1", int(splits)
    static_decode.O_SPLITS = int(rest[0]) if rest else 1
    static_decode.QKV_SPLITS = int(rest[1]) if len(rest) > 1 else 1
    static_decode.KV_WRITE_IN_ATTENTION = rest[2] == "1" if len(rest) > 2 else False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=sorted(QWEN2_SIZES))
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "gpu_models")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--compile", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument(
        "--compile-modes",
        nargs="+",
        default=["default"],
        choices=["default", "max-autotune-no-cudagraphs"],
    )
    parser.add_argument("--engine-modes", nargs="+", default=["auto", "off"])
    parser.add_argument("--engine-pipeline", nargs="+", default=["on", "off"])
    parser.add_argument(
        "--engine-streams",
        nargs="+",
        default=["own"],
        choices=["own", "default"],
        help="the engine's step thread on a high-priority stream of its own (the engine's "
        "default) or on the device's default stream (torch_engine.OWN_STREAM)",
    )
    parser.add_argument("--engine-batches", type=int, nargs="+", default=None)
    parser.add_argument(
        "--steps-per-launch",
        type=int,
        nargs="+",
        default=[1, 4],
        help="decode steps per graph replay (graph rows) and per engine launch (engine rows, "
        "policy.generation.torch.steps_per_launch)",
    )
    parser.add_argument("--workload", default="uniform", choices=["uniform", "longtail"])
    parser.add_argument("--admission-batches", type=int, nargs="+", default=[0])
    parser.add_argument("--bandwidth-tbps", type=float, default=4.22)
    parser.add_argument("--attention", nargs="+", default=["kernel"], choices=["kernel", "torch"])
    parser.add_argument("--sampler", nargs="+", default=["kernel"], choices=["kernel", "torch"])
    parser.add_argument(
        "--attention-configs",
        nargs="+",
        default=None,
        help="decode_attention launch shapes to time in the graph, as "
        "BLOCK_N:WARPS:STAGES[:SPLITS] (SPLITS: programs per row and KV head, default 1)",
    )
    parser.add_argument(
        "--step-variants",
        nargs="+",
        default=None,
        help="ROPE:SPLITS[:O_SPLITS[:QKV_SPLITS[:KV_WRITE]]] forms of the decode step to time "
        "(KV_WRITE 1: the attention kernel writes the new keys/values; default: the module's "
        "defaults)",
    )
    parser.add_argument("--profile-prefill", action="store_true")
    parser.add_argument("--skip-graph", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    folder = build_model_folder(
        args.size, args.models / f"qwen2-{args.size}", device="cuda" if cuda else "cpu"
    )
    model = load_causal_lm(folder, dtype="auto", device="auto")
    result: dict[str, Any] = {"size": args.size, "check_rel_err": check(model, 24, seed=0)}
    print(f"check: relative error {result['check_rel_err']:.2e}", flush=True)
    if cuda and not args.check_only:
        if args.profile_prefill:
            result["prefill"] = [
                profile_prefill(model, rows, args.context) for rows in args.batches
            ]
            print("prefill", json.dumps(result["prefill"]), flush=True)
        result["graph"] = []
        launch = attention_launch()
        configs = [(*(int(x) for x in c.split(":")), 1)[:4] for c in args.attention_configs or []]
        defaults = (
            f"{int(static_decode.ROPE_IN_ATTENTION)}:{static_decode.DOWN_SPLITS}"
            f":{static_decode.O_SPLITS}:{static_decode.QKV_SPLITS}"
            f":{int(static_decode.KV_WRITE_IN_ATTENTION)}"
        )
        graph_variants = [
            (a, s_, c, m, shape, v, k)
            for v in args.step_variants or [defaults]
            for a in args.attention
            for s_ in args.sampler
            for c in args.compile
            for m in (args.compile_modes if c == "on" else ["default"])
            for shape in (configs if a == "kernel" and configs else [launch])
            for k in args.steps_per_launch
        ]
        for attention, sampler, compile_flag, mode, shape, variant, per_launch in (
            [] if args.skip_graph else graph_variants
        ):
            set_step_variant(variant)
            decode_attention.USE_KERNEL = attention == "kernel"
            decode_sampler.USE_KERNEL = sampler == "kernel"
            set_attention_launch(shape)
            for rows in args.batches:
                started = time.perf_counter()
                try:
                    row = bench_graph(
                        model,
                        rows,
                        args.context,
                        args.steps,
                        compile_flag == "on",
                        args.bandwidth_tbps,
                        None if mode == "default" else mode,
                        per_launch,
                    )
                except Exception as exc:  # report and keep measuring the other variants
                    row = {"rows": rows, "compile": compile_flag, "error": repr(exc)[:2000]}
                row.update(
                    attention=attention,
                    sampler=sampler,
                    compile_mode=mode,
                    attention_launch=shape,
                    step_variant=variant,
                )
                row["wall_s"] = time.perf_counter() - started
                result["graph"].append(row)
                summary = {k: v for k, v in row.items() if k != "top"}
                print("graph", json.dumps(summary), flush=True)
                print("  top", json.dumps(row.get("top", [])[:25]), flush=True)
                torch._dynamo.reset()  # each variant compiles afresh (and frees its graphs)
        set_attention_launch(launch)
        set_step_variant(defaults)
        del model
        torch.cuda.empty_cache()
        result["engine"] = []
        engine_variants = [
            (a, s_, m, p == "on", b, st, k)
            for a in args.attention
            for s_ in args.sampler
            for m in args.engine_modes
            for p in args.engine_pipeline
            for b in args.admission_batches
            for st in args.engine_streams
            for k in args.steps_per_launch
        ]
        for attention, sampler, mode, pipeline, admission, stream, per_launch in (
            [] if args.skip_engine else engine_variants
        ):
            torch_engine.OWN_STREAM = stream == "own"
            if mode == "off" and (
                not pipeline
                or attention != args.attention[0]
                or sampler != args.sampler[0]
                or per_launch != args.steps_per_launch[0]
            ):
                continue  # the dynamic path has no pipeline and no static attention/sampler
            decode_attention.USE_KERNEL = attention == "kernel"
            decode_sampler.USE_KERNEL = sampler == "kernel"
            for rows in args.engine_batches or args.batches:
                try:
                    row = asyncio.run(
                        bench_engine(
                            folder,
                            rows,
                            args.context,
                            args.steps,
                            mode,
                            pipeline,
                            admission or None,
                            args.workload,
                            args.bandwidth_tbps,
                            per_launch,
                        )
                    )
                except Exception as exc:
                    row = {"rows": rows, "cuda_graphs": mode, "error": repr(exc)[:2000]}
                row.update(attention=attention, sampler=sampler, stream=stream)
                result["engine"].append(row)
                print("engine", json.dumps(row), flush=True)
    write_result(args.out, "decode_graph", result)


if __name__ == "__main__":
    main()
