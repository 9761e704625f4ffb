"""What the agents' policy endpoint costs: calls per second, and its share of a step's time.

Three measurements, one ``RESULT {json}`` line:

1. Chat completions per second, with 128 calls in flight (a step's episodes of the
   exemplar), three ways to the same engine: direct engine calls (``GenerationPool.generate``
   on prompt ids rendered beforehand), the in-process client (``PolicyService``: checks,
   chat template, capture, openai objects), and the HTTP endpoint through the official
   ``openai`` client. Once with the fake engine (instant: the figure is the call path's own
   ceiling), once with the tiny model (``TorchGenerationEngine``, in this process).
2. ``endpoint_server_cpu_ms_per_call``: the endpoint's own CPU per chat call (this process's
   CPU time over the calls, the fake engine behind it), with the ``openai`` clients in
   ``--client-processes`` processes of their own (64 calls in flight each), as agent workers
   call it; the client's CPU is not in it.
3. ``endpoint_overhead_frac``: the agent exemplar (``examples/configs/grpo_tiny_cpu_agent.yaml``,
   a real ``tandemrl train`` on Ray) run with the HTTP endpoint and with the in-process
   client, alternating (``--rounds`` of each, interleaved), ``--steps`` steps per run; the
   median step time after ``--warmup`` steps of each variant, pooled over its runs:
   (step time through HTTP - step time in process) / step time through HTTP. Goal <= 0.15.
   ``--agent-workers N`` plays the HTTP variant's episodes in N worker processes
   (``env.agent.workers``) instead of on the controller's event loop;
   ``--also-controller-loop`` adds the HTTP run without them for comparison.

    python benchmarks/agent_endpoint.py [--rounds 2] [--steps 60] [--warmup 10] [--calls 1024]
        [--agent-workers 4 [--also-controller-loop]]

The machine's load (``os.getloadavg``) is printed with the result: on a shared 2-core box a
load above 2 makes every figure here slower and noisier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tandemrl.agents.episodes import EpisodeRegistry  # noqa: E402
from tandemrl.agents.inprocess import InProcessClient  # noqa: E402
from tandemrl.agents.runner import shared_openai_client  # noqa: E402
from tandemrl.agents.server import PolicyEndpoint  # noqa: E402
from tandemrl.agents.service import (  # noqa: E402
    PolicyService,
    ServiceSettings,
    single_token_stop,
    tokenizer_chat_renderer,
)
from tandemrl.codec import text_codec  # noqa: E402
from tandemrl.generation.fake import FakeGenerationBackend  # noqa: E402
from tandemrl.models import load_tokenizer, resolve_model_path  # noqa: E402
from tandemrl.records import GenerationRequest  # noqa: E402
from tandemrl.rollout.generation_pool import GenerationPool  # noqa: E402

EXEMPLAR = REPO / "examples" / "configs" / "grpo_tiny_cpu_agent.yaml"
GOAL_OVERHEAD_FRAC = 0.15
MESSAGES = [{"role": "user", "content": "583="}]


def service_over(engine: Any, tokenizer: Any) -> PolicyService:
    end = int(tokenizer.eos_token_id)  # the counting chat format ends turns with <eos>
    codec = text_codec(tokenizer, stop_token_ids=(end,))
    return PolicyService(
        GenerationPool([engine]),
        registry=EpisodeRegistry(),
        settings=ServiceSettings(
            served_model_name="policy",
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=(end,),
            max_tokens_per_turn=4,
            max_total_tokens=64,
            max_turns=1 << 30,
        ),
        render_chat=tokenizer_chat_renderer(tokenizer, codec.encode),
        encode=codec.encode,
        decode=codec.decode,
        stop_string_ids=single_token_stop(tokenizer),
    )


async def calls_per_second(
    service: PolicyService, *, calls: int, in_flight: int
) -> dict[str, float]:
    """Calls/s: direct engine calls, the in-process client, HTTP with the openai client."""
    pool = service.pool
    prompt_ids = service.render_chat(MESSAGES, None, {})
    episode = service.registry.open("bench", 0, 0)
    endpoint = PolicyEndpoint(service)
    await endpoint.start()
    http = shared_openai_client(endpoint.url).with_options(api_key=episode.key)
    local = InProcessClient(service, episode.key)
    counter = iter(range(1 << 40))

    async def direct() -> None:
        request = GenerationRequest(f"bench/{next(counter)}", prompt_ids, 4, 1.0, 1.0, (), 0)
        await pool.generate([request])

    async def through(client: Any) -> None:
        await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)

    variants = {
        "direct": direct,
        "in_process": lambda: through(local),
        "http": lambda: through(http),
    }
    rates: dict[str, float] = {}
    try:
        for name, call in variants.items():
            await asyncio.gather(*(call() for _ in range(in_flight)))  # warm-up, connections
            started = time.perf_counter()
            for _ in range(calls // in_flight):
                await asyncio.gather(*(call() for _ in range(in_flight)))
            rates[name] = (calls // in_flight) * in_flight / (time.perf_counter() - started)
    finally:
        await http.close()
        await endpoint.stop()
    return rates


# A client process of ``server_cpu_per_call``: ``calls`` chat calls, 64 in flight.
CLIENT_PROCESS = """
import asyncio, sys
from tandemrl.agents.runner import shared_openai_client

async def main(url, key, calls):
    client = shared_openai_client(url).with_options(api_key=key)
    gate = asyncio.Semaphore(64)
    messages = [{"role": "user", "content": "583="}]

    async def one():
        async with gate:
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)

    await asyncio.gather(*(one() for _ in range(calls)))
    await client.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def server_cpu_per_call(service: PolicyService, *, calls: int, processes: int) -> float:
    """Milliseconds of this process's CPU per chat call served to ``processes`` client
    processes of ``calls`` calls each (after a warm-up round of 64 each)."""
    episode = service.registry.open("server-cpu", 0, 0)
    endpoint = PolicyEndpoint(service)
    await endpoint.start()
    env = child_env()

    async def clients(count: int) -> None:
        started = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CLIENT_PROCESS,
                endpoint.url,
                episode.key,
                str(count),
                env=env,
            )
            for _ in range(processes)
        ]
        codes = [await process.wait() for process in started]
        if any(codes):
            raise RuntimeError(f"a client process of the server-CPU measurement failed: {codes}")

    try:
        await clients(64)  # imports, connections
        cpu = time.process_time()
        await clients(calls)
        cpu = time.process_time() - cpu
    finally:
        await endpoint.stop()
    return 1e3 * cpu / (calls * processes)


def child_env() -> dict[str, str]:
    """The environment of a process this benchmark starts: this checkout first on its path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "RAY_AUTH_MODE": "disabled"}


def tiny_engine(model_dir: Path) -> Any:
    from tandemrl.generation.torch_engine import TorchGenerationEngine

    return TorchGenerationEngine(model_dir, device="cpu", dtype="float32", max_batch_size=256)


def learning(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """How the reward moved: first and last 20 steps, and when (seconds of steps, step) the
    20-step mean first stood 0.3 above the first 20 steps'; where the run's time went: the
    warm-up steps' sum, and the 90th percentile and the slowest of the steps after them."""
    rewards = [float(row["reward_mean"]) for row in rows]
    step_times = [float(row["step_time_s"]) for row in rows]
    measured = step_times[warmup:]
    window = min(20, len(rewards))
    first = sum(rewards[:window]) / window
    reached = None
    elapsed = 0.0
    for index, step_time in enumerate(step_times):
        elapsed += step_time
        if index + 1 >= window:
            mean = sum(rewards[index + 1 - window : index + 1]) / window
            if mean >= first + 0.3:
                reached = {"step": index + 1, "step_time_s_sum": round(elapsed, 1)}
                break
    return {
        "reward_first20": round(first, 4),
        "reward_last20": round(sum(rewards[-window:]) / window, 4),
        "plus_0_3_reached": reached,
        "step_time_s_sum": round(sum(step_times), 1),
        "warmup_step_time_s_sum": round(sum(step_times[:warmup]), 1),
        "step_time_s_p90": round(statistics.quantiles(measured, n=10)[-1], 4)
        if len(measured) > 1
        else None,
        "step_time_s_max": round(max(measured), 4) if measured else None,
    }


def exemplar_run(
    client: str, *, steps: int, workdir: Path, workers: int = 0
) -> list[dict[str, Any]]:
    """The metrics rows of one ``tandemrl train`` of the exemplar with ``env.agent.client``
    (and ``env.agent.workers``)."""
    log_dir = workdir / f"{client}-{workers}-{time.monotonic_ns()}"
    command = [
        sys.executable,
        "-m",
        "tandemrl.cli",
        "train",
        "--config",
        str(EXEMPLAR),
        f"env.agent.client={client}",
        f"env.agent.workers={workers}",
        f"grpo.max_num_steps={steps}",
        f"logger.log_dir={log_dir}",
        "logger.progress=false",
        "logger.tensorboard=false",
        "logger.plot=false",
        "logger.save_final_model=false",
    ]
    subprocess.run(command, cwd=REPO, env=child_env(), check=True, capture_output=True)
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1024)
    parser.add_argument("--in-flight", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--skip-exemplar", action="store_true")
    parser.add_argument(
        "--agent-workers",
        type=int,
        default=0,
        help="env.agent.workers of the HTTP variant (0: agents on the controller's loop)",
    )
    parser.add_argument(
        "--also-controller-loop",
        action="store_true",
        help="with --agent-workers: also run HTTP with the agents on the controller's loop",
    )
    args = parser.parse_args()
    if args.calls // 2 < args.in_flight:  # the tiny model's round gets calls // 2
        parser.error(f"--calls {args.calls} must be at least twice --in-flight {args.in_flight}")
    torch.set_num_threads(1)
    # As in a run (tandemrl.controller.run.init_ray): the endpoint's tokenizer calls without
    # the tokenizers library's thread pool.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    load_before = os.getloadavg()

    model_dir = resolve_model_path("tiny://qwen2-counting-chat")
    tokenizer = load_tokenizer(model_dir)
    vocab = len(tokenizer)
    fake = asyncio.run(
        calls_per_second(
            service_over(FakeGenerationBackend(vocab_size=vocab), tokenizer),
            calls=args.calls,
            in_flight=args.in_flight,
        )
    )
    server_cpu = asyncio.run(
        server_cpu_per_call(
            service_over(FakeGenerationBackend(vocab_size=vocab), tokenizer),
            calls=args.calls * 2,
            processes=args.client_processes,
        )
    )
    tiny = asyncio.run(
        calls_per_second(
            service_over(tiny_engine(model_dir), tokenizer),
            calls=args.calls // 2,
            in_flight=args.in_flight,
        )
    )
    result: dict[str, Any] = {
        "fake_engine_calls_per_s": {k: round(v, 1) for k, v in fake.items()},
        "tiny_model_calls_per_s": {k: round(v, 1) for k, v in tiny.items()},
        "fake_http_over_direct": round(fake["http"] / fake["direct"], 4),
        "tiny_http_over_direct": round(tiny["http"] / tiny["direct"], 4),
        "endpoint_server_cpu_ms_per_call": round(server_cpu, 4),
        "client_processes": args.client_processes,
    }
    if not args.skip_exemplar:
        # variant -> (env.agent.client, env.agent.workers)
        variants = {"http": ("http", args.agent_workers), "in_process": ("in_process", 0)}
        if args.agent_workers and args.also_controller_loop:
            variants["http_controller_loop"] = ("http", 0)
        times: dict[str, list[float]] = {name: [] for name in variants}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        with tempfile.TemporaryDirectory(prefix="agent-endpoint-") as scratch:
            for _ in range(args.rounds):
                for name, (client, workers) in variants.items():
                    rows = exemplar_run(
                        client, steps=args.steps, workdir=Path(scratch), workers=workers
                    )
                    times[name] += [float(row["step_time_s"]) for row in rows[args.warmup :]]
                    runs[name].append(learning(rows, args.warmup))
        http_step = statistics.median(times["http"])
        local_step = statistics.median(times["in_process"])
        overhead = (http_step - local_step) / http_step
        result.update(
            {
                "agent_workers": args.agent_workers,
                "cpu_count": os.cpu_count(),
                "exemplar_step_s_http": round(http_step, 4),
                "exemplar_step_s_in_process": round(local_step, 4),
                "endpoint_overhead_frac": round(overhead, 4),
                "goal_endpoint_overhead_frac": GOAL_OVERHEAD_FRAC,
                "endpoint_overhead_goal_met": overhead <= GOAL_OVERHEAD_FRAC,
                "steps_measured_per_variant": len(times["http"]),
                "exemplar_learning": runs,
            }
        )
        if "http_controller_loop" in times:
            loop_step = statistics.median(times["http_controller_loop"])
            result["exemplar_step_s_http_controller_loop"] = round(loop_step, 4)
            result["endpoint_overhead_frac_controller_loop"] = round(
                (loop_step - local_step) / loop_step, 4
            )
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
