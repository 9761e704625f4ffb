"""Run functions on N trainer ranks in fresh processes (gloo on CPU) and collect the results.

Each rank is a fresh process (forked by a fork server that imported the trainer once) that joins a real ``torch.distributed`` group through
``tandemrl.training.rank_group`` (rank 0 opens the rendezvous and hands its address to the
others through a queue), calls ``fn(rank, world_size, *args)`` and sends back what it returns
(or the exception's text). Several phases of different world sizes run in one set of
processes, each in a group of its own. Used by the sharded-trainer tests; GPUs are hidden from the ranks
(gloo FSDP2 and visible GPUs do not mix, pytorch #132471).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

TIMEOUT_S = 600.0


def _rank_main(
    rank: int,
    phases: list[tuple[int, Callable[..., Any]]],
    queues: list[Any],
    results: Any,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    from tandemrl.training.rank_group import join_rank_group, leave_rank_group, open_rank_rendezvous

    outputs = []
    try:
        for (world_size, fn), queue in zip(phases, queues, strict=True):
            if rank >= world_size:
                outputs.append(None)
                continue
            if rank == 0:
                store, address = open_rank_rendezvous(world_size, 120.0, "gloo")
                for _ in range(world_size - 1):
                    queue.put(address)
                join_rank_group(address, 0, store=store)
            else:
                join_rank_group(queue.get(timeout=300.0), rank)
            outputs.append(fn(rank, world_size, *args))
            leave_rank_group()
        # Bytes, not tensors: torch would share tensors through file descriptors that close
        # with this process.
        payload = io.BytesIO()
        torch.save(outputs, payload)
        results.put((rank, "ok", payload.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        leave_rank_group()


def run_phases(phases: list[tuple[int, Callable[..., Any]]], *args: Any) -> list[list[Any]]:
    """For each (world_size, fn) in turn, ``fn(rank, world_size, *args)`` on ranks
    0..world_size-1 of one set of processes (spawned once, as many as the largest world
    size: starting a process and importing torch is the expensive part). Returns, per phase,
    the results by rank."""
    processes_needed = max(world for world, _ in phases)
    # A fork server that imported the trainer once forks every rank: on 2 cores, N ranks each
    # importing torch and transformers took most of the test's time.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "tandemrl.training.sharded_workers"])
    # One address queue per phase: a rank that skips a phase must not take its address.
    queues, results = [context.Queue() for _ in phases], context.Queue()
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        processes = [
            context.Process(target=_rank_main, args=(rank, phases, queues, results, args))
            for rank in range(processes_needed)
        ]
        for process in processes:
            process.start()
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
    by_rank: dict[int, list[Any]] = {}
    errors = []
    try:
        for _ in range(processes_needed):
            rank, status, value = results.get(timeout=TIMEOUT_S)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            else:
                by_rank[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [
        [by_rank[rank][index] for rank in range(world)] for index, (world, _) in enumerate(phases)
    ]
