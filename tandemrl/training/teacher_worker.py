"""A distillation teacher: a frozen causal LM that scores the student's completions.

``TeacherWorker.score(requests)`` answers each ``TeacherRequest`` (a prompt and the tokens the
student sampled after it) with the teacher's logprob of every completion token,
``log p_teacher(token_t | prompt, token_<t)`` from its raw logits (temperature 1: the teacher's
own distribution is the target). Requests are scored in micro-batches of
``micro_batch_size`` sequences, longest first, right padded; one forward pass per micro-batch,
no gradient. Like the generation worker it is a plain class (tests use it in-process);
``create_teacher_worker_actor`` starts it as a Ray actor, whose async methods run the model
in one worker thread so the actor keeps answering ``ping`` while it scores.

``colocated_with_trainer`` (a GPU run): the worker shares the trainer's GPU and refuses to
start when the device lacks room for its weights, with the key to change in the message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tandemrl.models import load_causal_lm, resolve_device, resolve_dtype
from tandemrl.records import TeacherRequest
from tandemrl.training.worker_common import SerialExecutor

# Free device memory a colocated teacher wants beyond its weights (activations of a batch).
COLOCATED_HEADROOM = 1.25


class TeacherWorker:
    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        name: str = "teacher",
        device: str = "auto",
        precision: str = "auto",
        micro_batch_size: int = 64,
        colocated_with_trainer: bool = False,
        torch_num_threads: int | None = 1,
    ) -> None:
        if torch_num_threads is not None:
            torch.set_num_threads(torch_num_threads)
        self.name = name
        self.model_path = Path(model_path)
        self.device = resolve_device(device)
        dtype = resolve_dtype(precision, self.device)
        if colocated_with_trainer and self.device.type == "cuda":
            _check_room(self.model_path, dtype, self.device, name)
        self.model = load_causal_lm(self.model_path, dtype=dtype, device=self.device)
        self.model.config.use_cache = False
        self.micro_batch_size = micro_batch_size
        self.pad_token_id = int(self.model.config.pad_token_id or 0)
        self.sequences_scored = 0
        self._executor = SerialExecutor()

    # ------------------------------------------------------------------ scoring

    def _score(self, requests: list[TeacherRequest]) -> list[list[float]]:
        order = sorted(range(len(requests)), key=lambda i: -_length(requests[i]))
        scored: list[list[float]] = [[] for _ in requests]
        with torch.no_grad():
            for start in range(0, len(order), self.micro_batch_size):
                chunk = order[start : start + self.micro_batch_size]
                for index, values in zip(
                    chunk, self._score_micro([requests[i] for i in chunk]), strict=True
                ):
                    scored[index] = values
        self.sequences_scored += len(requests)
        return scored

    def _score_micro(self, requests: list[TeacherRequest]) -> list[list[float]]:
        lengths = [_length(request) for request in requests]
        width = max(lengths)
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):
            tokens = [*request.prompt_token_ids, *request.completion_token_ids]
            input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            attention[row, : len(tokens)] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        logits = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        # Position t - 1 predicts token t.
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
        out = []
        for row, request in enumerate(requests):
            first = len(request.prompt_token_ids) - 1  # predicts the first completion token
            out.append(picked[row, first : first + len(request.completion_token_ids)].tolist())
        return out

    # ------------------------------------------------------------------ the actor's methods

    async def score(self, requests: list[TeacherRequest]) -> list[list[float]]:
        """Per request, the teacher's logprob of each completion token (see the module doc)."""
        for request in requests:
            if not request.prompt_token_ids:
                raise ValueError(f"teacher request {request.request_id}: empty prompt")
        return await self._executor.run(self._score, requests)

    async def ping(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "name": self.name,
            "device": str(self.device),
            "sequences_scored": self.sequences_scored,
            "torch_threads": torch.get_num_threads(),
        }


def _length(request: TeacherRequest) -> int:
    return len(request.prompt_token_ids) + len(request.completion_token_ids)


def _check_room(model_path: Path, dtype: torch.dtype, device: torch.device, name: str) -> None:
    """A teacher beside the trainer needs its weights' worth of free device memory (and some)."""
    weights = sum(path.stat().st_size for path in model_path.glob("*.safetensors"))
    # safetensors store the checkpoint's dtype; a float32 file loaded in bfloat16 takes half.
    needed = weights * (torch.finfo(dtype).bits / 32) * COLOCATED_HEADROOM
    free, _ = torch.cuda.mem_get_info(device)
    if free < needed:
        raise RuntimeError(
            f"teacher {name!r}: {free / 2**30:.1f} GiB free on {device} beside the trainer, its "
            f"weights need about {needed / 2**30:.1f} GiB; set "
            "on_policy_distillation.teachers.<i>.colocated_with_trainer: false to give it GPUs "
            "of its own"
        )


def create_teacher_worker_actor(
    model_path: str | os.PathLike[str],
    *,
    num_cpus: float,
    num_gpus: float,
    **options: Any,
) -> Any:
    """Start a ``TeacherWorker`` as a Ray actor reserving ``num_cpus`` / ``num_gpus``."""
    import ray

    actor_class = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=64)(
        TeacherWorker
    )
    return actor_class.remote(str(model_path), **options)
