"""Code that runs inside vLLM's worker process: the in-place weight reload of the vLLM backend.

vLLM loads this class as its ``worker_extension_cls``: it becomes a base of the worker, so the
engine reaches its methods through ``collective_rpc("tandemrl_reload_weights", ...)``. Nothing
here imports TandemRL beyond this module, so the worker process stays light.

Why not ``model.load_weights``: on the CPU build, linear layers keep only a prepacked copy of
their weight (the parameter itself is emptied after loading), so a plain load fails. The
worker's ``reload_weights`` restores each layer, loads, and re-runs the kernel preparation.

Why the extra ``lm_head`` step: with tied embeddings (Qwen2 tiny models) checkpoints carry no
``lm_head.weight``; the reload refreshes ``embed_tokens.weight`` (the same tensor) but never
re-prepares ``lm_head``. Where vLLM's CPU GEMM keeps a packed *copy* of the head (bf16/fp16 on
AMX CPUs) that copy keeps the old weights, and output mixes the new body with the old head,
silently; in float32 the oneDNN kernel reads the live tensor and the problem does not show.
Re-running the head's post-load step after every reload rebuilds whatever the kernel holds
from the current weight (cheap; harmless when untied or unpacked).

Why the experts step (CPU only): a mixture-of-experts layer's CPU kernel prepacks the expert
weights into its grouped-GEMM layout once, at load. A reload copies the new weights into that
storage in checkpoint layout and does not prepack again (vLLM 0.32; the family of
vllm-project/vllm#42821), so every later forward read unpacked data as packed: reloading the
very weights a Qwen3-MoE engine started with moved its logprobs by up to 6 nats
(tests/vllm/test_vllm_families.py). Re-running the experts' post-load step after the reload
prepacks what was just loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load as safetensors_load


class TandemrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    # Provided by the vLLM worker this class is mixed into.
    model_runner: Any

    def tandemrl_reload_weights(self, payload: bytes) -> int:
        """Load a safetensors-serialised state dict in place; returns the tensors loaded."""
        weights = safetensors_load(payload)
        self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
        self._tandemrl_refresh_lm_head()
        self._tandemrl_repack_cpu_experts()
        return len(weights)

    def _tandemrl_repack_cpu_experts(self) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        model = self.model_runner.get_model()
        with torch.inference_mode():
            for module in model.modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                experts = getattr(kernel, "fused_experts", None)
                if experts is not None and hasattr(module, "w13_weight"):
                    experts.process_weights_after_loading(module)

    def _tandemrl_refresh_lm_head(self) -> None:
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if lm_head is None or quant_method is None:
            return
        with torch.inference_mode():
            quant_method.process_weights_after_loading(lm_head)

    def tandemrl_weight_checksum(self) -> float:
        """Sum of every parameter of the served model (tests: did the reload land?)."""
        model = self.model_runner.get_model()
        with torch.inference_mode():
            return float(sum(p.double().sum() for p in model.parameters() if p.numel()))
