"""Prototype: Qwen2 decode with a static KV cache, replayed as one CUDA graph per step.

What the launch-bound transformers decode loop leaves on the table: this hand-written decode
step (fused QKV and gate/up projections, a static [layers, rows, kv_heads, max_len, head_dim]
cache written in place at each row's position, SDPA with grouped-query heads, Gumbel-max
sampling and the sampled token's logprob) has static shapes, so one step is captured once and
replayed; each replay feeds its own sampled tokens to the next. It is a measurement of the
ceiling for the engine's design, not yet the engine: it has no admission or retirement of
rows (continuous batching) and no prefill of its own (the check below prefills by decoding).

``check``: logits of the hand-written step against the transformers forward pass on the same
tokens (float32 on CPU: ~1e-6; bf16 on the GPU: ~1e-2, bf16 rounding).

    python benchmarks/gpu_decode.py --size tiny --check-only          # CPU
    python benchmarks/gpu_decode.py --size 0.5b --batches 64 256      # GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import QWEN2_SIZES, build_model_folder

from tandemrl.models import load_causal_lm


class StaticQwen2Decoder:
    """One decode step of a transformers Qwen2 model over a static cache (see module doc)."""

    def __init__(self, model: Any, rows: int, max_len: int) -> None:
        config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                attention, mlp = layer.self_attn, layer.mlp
                self.layers.append(
                    {
                        "in_norm": layer.input_layernorm.weight,
                        "post_norm": layer.post_attention_layernorm.weight,
                        "qkv_w": torch.cat(
                            [
                                attention.q_proj.weight,
                                attention.k_proj.weight,
                                attention.v_proj.weight,
                            ]
                        ),
                        "qkv_b": torch.cat(
                            [attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]
                        ),
                        "o_w": attention.o_proj.weight,
                        "gate_up_w": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                        "down_w": mlp.down_proj.weight,
                    }
                )
        self.final_norm = model.model.norm.weight
        self.lm_head = model.lm_head.weight
        theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
        exponent = torch.arange(0, self.head_dim, 2, device=self.device).float() / self.head_dim
        self.inv_freq = 1.0 / (theta**exponent)
        shape = (len(self.layers), rows, self.kv_heads, max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.rows = rows
        self.max_len = max_len
        self.row_index = torch.arange(rows, device=self.device)
        self.slots = torch.arange(max_len, device=self.device)
        # Static inputs/outputs of a step (a graph replay reads and writes these in place).
        self.tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.logprobs = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        as_float = hidden.float()
        as_float = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * as_float.to(hidden.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)

    @torch.no_grad()
    def logits_step(self, embed: torch.nn.Embedding) -> torch.Tensor:
        """Feed ``self.tokens`` at ``self.positions``; write the cache; return logits [rows, V]."""
        hidden = embed(self.tokens)[:, None, :]  # [rows, 1, hidden]
        freqs = self.positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [rows, 1, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        visible = (self.slots[None, :] <= self.positions[:, None])[:, None, None, :]
        q_size = self.heads * self.head_dim
        kv_size = self.kv_heads * self.head_dim
        for index, weights in enumerate(self.layers):
            x = self._norm(hidden, weights["in_norm"])
            qkv = F.linear(x, weights["qkv_w"], weights["qkv_b"])
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(self.rows, 1, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(self.rows, self.kv_heads, self.head_dim)
            v = v.view(self.rows, self.kv_heads, self.head_dim)
            q = self._rope(q, cos, sin)
            k = self._rope(k[:, :, None, :], cos, sin)[:, :, 0, :]
            self.keys[index, self.row_index, :, self.positions] = k
            self.values[index, self.row_index, :, self.positions] = v
            attended = F.scaled_dot_product_attention(
                q, self.keys[index], self.values[index], attn_mask=visible, enable_gqa=True
            )
            attended = attended.transpose(1, 2).reshape(self.rows, 1, q_size)
            hidden = hidden + F.linear(attended, weights["o_w"])
            x = self._norm(hidden, weights["post_norm"])
            gate, up = F.linear(x, weights["gate_up_w"]).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, weights["down_w"])
        hidden = self._norm(hidden, self.final_norm)
        return F.linear(hidden[:, 0, :], self.lm_head)

    @torch.no_grad()
    def sample_step(self, embed: torch.nn.Embedding) -> None:
        """One step that samples (temperature 1), records the logprob and advances in place."""
        logits = self.logits_step(embed).float()
        logprobs = torch.log_softmax(logits, dim=-1)
        gumbel = -torch.log(-torch.log(torch.rand_like(logprobs).clamp_(min=1e-20)))
        chosen = (logprobs + gumbel).argmax(dim=-1)
        self.logprobs.copy_(logprobs.gather(1, chosen[:, None])[:, 0])
        self.tokens.copy_(chosen)
        self.positions.add_(1)

    def capture(self, embed: torch.nn.Embedding) -> None:
        saved = self.positions.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.sample_step(embed)
        torch.cuda.current_stream().wait_stream(stream)
        self.positions.copy_(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.sample_step(embed)
        self.positions.copy_(saved)


def check(model: Any, length: int, seed: int) -> float:
    """max |hand-written - transformers| / max |transformers| over the last position's logits."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, model.config.vocab_size, (2, length), generator=generator).to(device)
    with torch.no_grad():
        reference = model(input_ids=tokens).logits[:, -1].float()
    decoder = StaticQwen2Decoder(model, rows=2, max_len=length)
    embed = model.get_input_embeddings()
    for position in range(length):
        decoder.tokens.copy_(tokens[:, position])
        decoder.positions.fill_(position)
        logits = decoder.logits_step(embed).float()
    return float((logits - reference).abs().max() / reference.abs().max())


def bench(model: Any, rows: int, context: int, steps: int) -> dict[str, float]:
    decoder = StaticQwen2Decoder(model, rows=rows, max_len=context + steps + 8)
    embed = model.get_input_embeddings()
    decoder.keys.normal_()
    decoder.values.normal_()
    decoder.tokens.random_(3, model.config.vocab_size)
    decoder.positions.fill_(context)
    decoder.capture(embed)
    assert decoder.graph is not None
    decoder.graph.replay()
    torch.cuda.synchronize()
    decoder.positions.fill_(context)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        decoder.graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_s = start.elapsed_time(end) / 1e3 / steps
    assert bool(torch.isfinite(decoder.logprobs).all()), "non-finite logprobs"
    return {
        "rows": rows,
        "context": context + steps / 2,
        "step_ms": step_s * 1e3,
        "tok_s": rows / step_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b", choices=sorted(QWEN2_SIZES))
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "gpu_models")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
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
        result["rows"] = []
        for rows in args.batches:
            started = time.perf_counter()
            result["rows"].append(bench(model, rows, args.context, args.steps))
            result["rows"][-1]["wall_s"] = time.perf_counter() - started
            print(json.dumps(result["rows"][-1]), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_graph.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
