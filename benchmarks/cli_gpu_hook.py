"""Ray worker setup hook of ``cli_gpu.py``: the long-tail completion lengths of ``gpu_grpo.py``.

``gpu_grpo.py`` draws each request's completion length from ``gpu_common.LongTail`` (keyed on
the request id) and caps its ``max_new_tokens`` there. ``cli_gpu.py`` runs the real
``tandemrl train``, whose engines live in Ray worker processes; Ray runs ``apply`` in each
worker at start (``runtime_env={"worker_process_setup_hook": "cli_gpu_hook.apply"}``), which
wraps ``TorchGenerationEngine.generate`` the same way, so both paths decode the same lengths.
The distribution comes from ``TANDEMRL_BENCH_LONG_TAIL`` ("median,sigma,cap").
"""

from __future__ import annotations

import dataclasses
import os

ENV = "TANDEMRL_BENCH_LONG_TAIL"


def apply() -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    from gpu_common import LongTail

    from tandemrl.generation.torch_engine import TorchGenerationEngine

    median, sigma, cap = spec.split(",")
    lengths = LongTail(median=float(median), sigma=float(sigma), cap=int(cap))
    original = TorchGenerationEngine.generate
    if getattr(original, "_long_tail", False):
        return

    async def generate(self, requests):  # type: ignore[no-untyped-def]
        requests = [
            dataclasses.replace(
                request,
                max_new_tokens=min(request.max_new_tokens, lengths.length(request.request_id)),
            )
            for request in requests
        ]
        return await original(self, requests)

    generate._long_tail = True  # type: ignore[attr-defined]
    TorchGenerationEngine.generate = generate  # type: ignore[method-assign]
