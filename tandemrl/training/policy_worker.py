"""The policy trainer: a transformers causal LM trained with the clipped PG loss.

``PolicyWorker`` implements ``tandemrl.training.api.Trainer``. It is a plain class (tests and
in-process runs use it directly); ``create_policy_worker_actor`` starts it as a Ray actor.

One RL step::

    get_logprobs(batch)            -> prev_logprobs (no grad; may run mid-step; skipped with
                                      loss_fn.reuse_training_logprobs, see below)
    get_reference_logprobs(batch)  -> reference_logprobs (no grad; only with
                                      loss_fn.reference_policy_kl_penalty > 0: the worker
                                      then keeps a frozen copy of the initial weights)
    begin_train_step()             zero gradients
    train_microbatches(chunk, step_num_sequences=S, step_num_tokens=N)   once per chunk
    finish_train_step()            clip, exactly one optimizer step, metrics

Gradients of all chunks accumulate into one optimizer step. Normalization over the whole step
(see ``tandemrl.training.losses``): with ``step_num_tokens=N`` every micro-batch loss is its
token sum / N (sequence mean: its sequences' means / S); without it (streaming, the step's size
unknown until the last chunk) the sums are divided by ``step_num_sequences``, a provisional
constant, and ``finish_train_step`` rescales the accumulated gradient by S / N (sequence mean:
S / the rows the chunks held) before clipping. Both give the gradient of the unsplit step of
the rows actually trained, also when a dropped prompt left the step fewer than S rows.
A step whose chunks hold no valid token raises ``AllMaskedStepError`` and takes no step.

Logprobs: entry t of the returned [B, L] tensor is log p(input_ids[t] | input_ids[:t]), 0 at
t = 0 and on padding. They are computed from ``logits / policy.generation.temperature`` when
that temperature is > 0 — the same ``log_softmax(logits / temperature)`` that the generation
engine records for the tokens it samples — so that at equal weights trainer and generator
logprobs agree and the importance weight is 1. Temperature 0 (greedy) uses the raw logits.
``top_p`` truncation is not reflected (the generator reports untruncated logprobs too).
For Qwen2/Qwen3/Llama/Mistral models (logits = a bias-free lm_head of the last hidden state)
they come from ``logprob_head.head_logprobs``: only at the positions that need them (loss
positions in training, real tokens in ``get_logprobs``), chunked, never materialising float32
[tokens, vocab] logits; other models take the full-logits path. Right-padded micro-batches run
without the padding mask (causal attention already ignores trailing padding; how a model is
told so: ``causal_mask.py``), so attention takes the fused causal kernel. With ``policy.sequence_packing`` (on CUDA by default) they run
without the padding at all: each micro-batch's rows are packed into one sequence with
attention kept within rows (``tandemrl.training.packing``), micro-batches are cut by real
tokens (``train_micro_batch_tokens``), and the loss sees the same [b, l] logprobs.

``prev_logprobs`` may be absent from a train batch only with
``loss_fn.reuse_training_logprobs``: each micro-batch then uses its own training logprobs,
detached — exact because gradients accumulate and the weights change only in
``finish_train_step``. The micro-batch loop never waits for the device: inputs are cut and
moved before it, metrics stay on the device and come back in one transfer per chunk.

Vision-language models (``policy.is_vlm``, ``models.vision``): a batch's image fields
(``mm.*``, ``training.batch``) go to the forward as the processor's ``pixel_values`` and
``image_grid_thw`` of the micro-batch's rows, with the 3-D rotary positions of
``vision_position_ids`` computed on the host from the same tokens and grids the engine's
prefill used; logprobs are then taken at the loss positions exactly as for text. Their rows
are never packed (``sequence_packing: auto`` leaves packing off for them, with a log line;
``on`` is refused).

Precision: parameters and optimizer state are float32; "auto" runs forward/backward under
bfloat16 autocast on CUDA and in plain float32 on CPU.

``offload_optimizer_for_logprob``: ``get_logprobs`` moves the optimizer state to host memory
(it stays there while the critic runs) and ``finish_train_step`` moves it back just before the
optimizer step. On CPU there is nothing to move; the transitions are only recorded
(``optimizer_location``, ``state()["optimizer_transitions"]``).

Checkpoint folder layout (``save_checkpoint``): ``config.json`` + ``model.safetensors`` (via
``save_pretrained``), the source folder's tokenizer files, ``worker_state.json``
(``optimizer_steps``), and with ``save_optimizer`` ``optimizer.pt`` (optimizer + scheduler,
read back with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tandemrl.config.models import LossConfig, PolicyConfig
from tandemrl.dataplane.atomic import atomic_directory
from tandemrl.models import resolve_device, resolve_model_path
from tandemrl.models.vision import (
    is_vision_model,
    load_policy_model,
    vision_position_ids,
)
from tandemrl.training.api import TrainBatch
from tandemrl.training.batch import (
    count_loss_tokens,
    loss_mask,
    multimodal_inputs,
    split_microbatches,
    trim_padding,
)
from tandemrl.training.causal_mask import no_mask_argument
from tandemrl.training.logprob_head import supports_head_logprobs
from tandemrl.training.losses import metrics_to_floats, policy_loss_terms
from tandemrl.training.packing import (
    PackedRows,
    pack_rows,
    packing_blocker,
    split_packed,
    use_packed_attention,
    varlen_attention_available,
)
from tandemrl.training.policy_forward import Micro, PolicyForward
from tandemrl.training.rank_group import LocalReplicas, Replicas
from tandemrl.training.worker_common import (
    SHARDED_LAYOUT,
    CheckpointError,
    OptimizerOffload,
    SerialExecutor,
    SplitStepWorkerAPI,
    StepTracker,
    autocast_dtype,
    build_optimizer,
    build_scheduler,
    grad_norm_and_clip,
    load_optimizer_state,
    read_worker_state,
    save_optimizer_state,
    scale_gradients,
    write_worker_state,
)
from tandemrl.transport.object_store import FlatWeights
from tandemrl.transport.sender import WeightSenderHost

# Files of a model folder that belong to the tokenizer (copied into every checkpoint so that a
# checkpoint folder is itself loadable with from_pretrained).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    # A vision-language model's processor (models.vision.load_processor).
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)

log = logging.getLogger(__name__)


def copy_tokenizer_files(source: Path, target: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """True when every row is ones then zeros (real tokens first, padding after).

    For such rows a causal model computes the same outputs at every real position without
    the padding mask (a real token only attends to earlier, real tokens), and attention can
    take the fused causal kernel instead of a masked one.
    """
    lengths = attention_mask.sum(dim=1, keepdim=True)
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return bool(torch.equal(attention_mask != 0, columns.unsqueeze(0) < lengths))


def split_by_rows_and_tokens(
    batch: TrainBatch, max_rows: int, max_tokens: int | None
) -> list[TrainBatch]:
    """Consecutive micro-batches of at most ``max_rows`` rows and, when ``max_tokens`` is set,
    at most ``max_tokens`` padded tokens (rows x the longest row's real length; a row longer
    than the budget goes alone). Meant for length-sorted rows (longest first), where it keeps
    the padded size of every micro-batch near the budget: long rows go in small groups,
    short rows in large ones."""
    if max_tokens is None:
        return split_microbatches(batch, max_rows)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    bounds, start, longest = [], 0, 0
    for index, length in enumerate(lengths):
        longest_with = max(longest, length)
        rows = index - start + 1
        if index > start and (rows > max_rows or rows * longest_with > max_tokens):
            bounds.append((start, index))
            start, longest_with = index, length
        longest = longest_with
    bounds.append((start, len(lengths)))
    return slice_rows(batch, bounds)


def split_packed_rows(batch: TrainBatch, max_rows: int, max_tokens: int | None) -> list[TrainBatch]:
    """Consecutive micro-batches for packing: at most ``max_rows`` rows and, when set, at most
    ``max_tokens`` real tokens each (``packing.split_packed``)."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return slice_rows(batch, split_packed(lengths, max_rows, max_tokens))


def slice_rows(batch: TrainBatch, bounds: list[tuple[int, int]]) -> list[TrainBatch]:
    """``batch``'s rows ``lo:hi`` for each (lo, hi) of ``bounds`` (fields without the batch
    dimension are shared)."""
    size = batch["input_ids"].shape[0]
    return [
        {
            key: value[lo:hi] if value.dim() > 0 and value.shape[0] == size else value
            for key, value in batch.items()
        }
        for lo, hi in bounds
    ]


def sort_rows_by_length(batch: TrainBatch) -> tuple[TrainBatch, torch.Tensor]:
    """``batch`` with its rows ordered longest first, and that order (``sorted[i] = batch[order[i]]``).

    Consecutive micro-batches of length-sorted rows pad to similar lengths, so far fewer
    padding tokens go through the model (on the H200 benchmark, 62 k padded tokens became
    about 36 k for 35 k real ones). Losses are sums over rows divided by step-wide counts, so
    the order changes neither the loss nor the gradient (up to summation order).
    """
    size = batch["input_ids"].shape[0]
    order = torch.argsort(batch["attention_mask"].sum(dim=1), descending=True, stable=True)
    reordered = {
        key: value.index_select(0, order) if value.dim() > 0 and value.shape[0] == size else value
        for key, value in batch.items()
    }
    return reordered, order


class PolicyWorker(SplitStepWorkerAPI, WeightSenderHost):
    """Trains the policy; see the module docstring for the step protocol and file layout."""

    # The other ranks of a sharded trainer (none here: every reduction is the identity).
    replicas: Replicas = LocalReplicas()

    def __init__(
        self,
        policy_cfg: PolicyConfig,
        loss_cfg: LossConfig,
        *,
        model_path: str | os.PathLike[str] | None = None,
        seed: int = 0,
        torch_num_threads: int | None = None,
    ) -> None:
        if torch_num_threads is not None:
            torch.set_num_threads(torch_num_threads)
        if policy_cfg.megatron_cfg.enabled:
            raise ValueError(
                "policy.megatron_cfg.enabled: true is not supported by the torch PolicyWorker; "
                "set it to false"
            )
        torch.manual_seed(seed)
        self.cfg = policy_cfg
        self.loss_cfg = loss_cfg
        self.seed = seed
        self.model_path = Path(
            resolve_model_path(str(model_path) if model_path is not None else policy_cfg.model_name)
        )
        self.device = resolve_device(policy_cfg.device)
        self.autocast_dtype = autocast_dtype(policy_cfg.precision, self.device)
        self.temperature = policy_cfg.generation.temperature
        self.model = load_policy_model(self.model_path, dtype=torch.float32, device=self.device)
        self.is_vlm = is_vision_model(self.model)
        self.model.config.use_cache = False
        # Logprobs from the hidden states through the chunked head (logprob_head.py) where
        # the model's logits are a plain lm_head; the full-logits path otherwise.
        self.use_head_logprobs = supports_head_logprobs(self.model)
        # What right-padded and packed micro-batches pass as the attention mask: plain causal
        # attention, with no mask built where the model allows it (causal_mask.py).
        self._no_mask = no_mask_argument(self.model)
        self.sequence_packing = self._resolve_packing(policy_cfg.sequence_packing)
        if self.sequence_packing:
            use_packed_attention(self.model)
        if policy_cfg.compile_layers:
            for layer in self._decoder_layers():
                layer.compile(dynamic=True)
        if policy_cfg.dtensor_cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable()
        # The frozen reference policy of the KL penalty: the initial weights of the model
        # folder (a resumed run loads its checkpoint into self.model, never into this one).
        self.reference_model: torch.nn.Module | None = None
        self.reference_forward: PolicyForward | None = None
        if loss_cfg.reference_policy_kl_penalty > 0:
            self.reference_model = load_policy_model(
                self.model_path, dtype=torch.float32, device=self.device
            )
            self.reference_model.config.use_cache = False
            self.reference_model.requires_grad_(False)
            self.reference_model.eval()
            if self.sequence_packing:
                use_packed_attention(self.reference_model)
            self.reference_forward = PolicyForward(
                self.reference_model,
                use_head_logprobs=self.use_head_logprobs,
                temperature=self.temperature,
                device=self.device,
                autocast_dtype=self.autocast_dtype,
                is_vlm=self.is_vlm,
            )
        self.forward_module = PolicyForward(
            self.model,
            use_head_logprobs=self.use_head_logprobs,
            temperature=self.temperature,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            is_vlm=self.is_vlm,
        )
        self._shard_model()  # the trained model only: the frozen reference is never sharded
        self.optimizer = build_optimizer(self.model.parameters(), policy_cfg.optimizer, self.device)
        self.scheduler = build_scheduler(self.optimizer, policy_cfg.scheduler)
        self._offload = OptimizerOffload(self.optimizer, self.device)
        self._step = StepTracker()
        self._executor = SerialExecutor()
        self.optimizer_steps = 0
        self._process_cpu_mark = time.process_time()

    def _resolve_packing(self, setting: str) -> bool:
        """``policy.sequence_packing`` for this model and device (see PolicyConfig)."""
        if setting == "off":
            return False
        if self.is_vlm:
            blocker = "vision-language rows carry 3-D rotary positions and image tensors per row"
            if setting == "on":
                raise ValueError(
                    f"policy.sequence_packing: on cannot pack this model ({blocker}); "
                    "set it to auto or off"
                )
            log.info("policy.sequence_packing=auto: packing off for this model (%s)", blocker)
            return False
        blocker = packing_blocker(self.model)
        if blocker is None and not self.use_head_logprobs:
            blocker = "its logits are not a plain lm_head of the last hidden state"
        if setting == "on":
            if blocker is not None:
                raise ValueError(
                    f"policy.sequence_packing: on cannot pack this model ({blocker}); "
                    "set it to auto or off"
                )
            return True
        # auto: only where the flash kernel runs (CUDA, half-precision compute); the reference
        # attention of other devices builds a [tokens, tokens] mask and is slower than padding.
        half = self.autocast_dtype in (torch.float16, torch.bfloat16)
        return blocker is None and half and varlen_attention_available()

    def _shard_model(self) -> None:
        """Nothing to shard in one process (the sharded worker applies FSDP2 here)."""

    def _decoder_layers(self) -> torch.nn.ModuleList:
        layers = getattr(self.model.base_model, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise ValueError(
                "policy.compile_layers: true and policy.dtensor_cfg.data_parallel_size > 1 need "
                "a model whose base model keeps its decoder layers in .layers "
                f"({type(self.model).__name__} does not); set them to false and 1"
            )
        return layers

    # ------------------------------------------------------------------ properties

    @property
    def optimizer_location(self) -> str:
        """ "device" or "cpu": where the optimizer state lives (see OptimizerOffload)."""
        return self._offload.location

    def state(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "optimizer_location": self._offload.location,
            "optimizer_transitions": list(self._offload.transitions),
            "in_train_step": self._step.active,
            "lr": float(self.scheduler.get_last_lr()[0]),
        }

    # ------------------------------------------------------------------ forward

    def _to_device(self, batch: TrainBatch) -> TrainBatch:
        return {key: value.to(self.device) for key, value in batch.items()}

    def _check_length(self, batch: TrainBatch) -> None:
        longest = int(batch["attention_mask"].sum(dim=1).max().item())
        if longest > self.cfg.max_total_sequence_length:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds policy.max_total_sequence_length="
                f"{self.cfg.max_total_sequence_length}"
            )

    def _packs(self, batch: TrainBatch) -> bool:
        """Whether ``batch``'s micro-batches run packed (right-padded rows only: packed
        positions restart at 0 per row, as a right-padded row's do; every row non-empty)."""
        mask = batch["attention_mask"]
        return self.sequence_packing and is_right_padded(mask) and bool((mask[:, 0] != 0).all())

    def _split(self, batch: TrainBatch, packed: bool) -> list[TrainBatch]:
        split = split_packed_rows if packed else split_by_rows_and_tokens
        return split(batch, self.cfg.train_micro_batch_size, self.cfg.train_micro_batch_tokens)

    def _prepare(self, micro: TrainBatch, needed: torch.Tensor, packed: bool = False) -> Micro:
        """Move a (trimmed, CPU) micro-batch to the device with its head indices.

        ``needed`` [b, l] bool: positions whose logprob matters (entry 0 never does). All
        index arithmetic happens here on the host, so the forward never waits for the device.
        ``packed``: the rows go to the model as one packed sequence (``packing.pack_rows``).
        """
        needed = needed.clone()
        needed[:, 0] = False
        index = needed.reshape(-1).nonzero().squeeze(1)
        targets = micro["input_ids"].reshape(-1).index_select(0, index)
        batch = self._to_device(micro)
        if packed:
            rows: PackedRows = pack_rows(micro["input_ids"], micro["attention_mask"])
            hidden_index = rows.packed_index(index, micro["input_ids"].shape[1]) - 1
            rows = rows.to(self.device)
            model_inputs = {
                "input_ids": rows.input_ids,
                "attention_mask": self._no_mask,
                **rows.model_kwargs(),
            }
        else:
            hidden_index = index - 1
            right_padded = is_right_padded(micro["attention_mask"])
            model_inputs = {
                "input_ids": batch["input_ids"],
                "attention_mask": self._no_mask if right_padded else batch["attention_mask"],
            }
            if self.is_vlm:
                model_inputs.update(self._vision_inputs(micro))
        return Micro(
            batch=batch,
            needed=index.to(self.device),
            targets=targets.to(self.device),
            hidden_index=hidden_index.to(self.device),
            model_inputs=model_inputs,
        )

    def _vision_inputs(self, micro: TrainBatch) -> dict[str, Any]:
        """A vision-language micro-batch's 3-D positions, prompt mask and image inputs, on
        the device (``PolicyForward`` turns them into the forward's embeddings)."""
        images = multimodal_inputs(micro)
        grids = images.get("image_grid_thw")
        prompt_mask = (micro["token_mask"] == 0) & (micro["attention_mask"] != 0)
        positions, _deltas = vision_position_ids(
            self.model, micro["input_ids"], micro["attention_mask"], grids, prompt_mask
        )
        pixels = images.get("pixel_values")
        return {
            "position_ids": positions.to(self.device),
            "image_prompt_mask": prompt_mask.to(self.device),
            "pixel_values": None if pixels is None else pixels.to(self.device, self.model.dtype),
            "image_grid_thw": None if grids is None else grids.to(self.device),
        }

    def _forward(
        self, micro: Micro, *, entropy: str, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs [b, l], entropy [b, l] or None); ``entropy``: "none", "metric" or "grad".

        One call of ``self.forward_module`` (``PolicyForward``): the sharded worker's FSDP2
        root unit, so that its parameters are gathered around it. ``model``: the trained model
        (default) or the frozen reference (``self.reference_forward``, same architecture).
        """
        if model is None or model is self.model:
            return self.forward_module(micro, entropy=entropy)
        assert self.reference_forward is not None and model is self.reference_model
        return self.reference_forward(micro, entropy=entropy)

    def _get_logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        self._check_length(batch)
        if self.cfg.offload_optimizer_for_logprob:
            self._offload.offload()
        model = self._reference() if reference else self.model
        was_training = model.training
        model.eval()
        batch, order = sort_rows_by_length(batch)
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32, device=self.device)
        packed = self._packs(batch)
        micros = [trim_padding(micro) for micro in self._split(batch, packed)]
        passes = self.replicas.max_int(len(micros))  # before any pass: collectives line up
        start = 0
        with torch.no_grad():
            for micro in micros:
                size, length = micro["input_ids"].shape
                prepared = self._prepare(micro, micro["attention_mask"] != 0, packed)
                logprobs, _ = self._forward(prepared, entropy="none", model=model)
                mask = prepared.batch["attention_mask"].to(logprobs.dtype)
                out[start : start + size, :length] = logprobs * mask
                start += size
            if not reference:  # the reference is never sharded: no collectives to line up
                self._idle_passes(passes - len(micros), train=False)
        model.train(was_training)
        out = out.cpu()  # the one wait for the device
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted

    def _reference(self) -> torch.nn.Module:
        if self.reference_model is None:
            raise ValueError(
                "get_reference_logprobs needs a reference policy: set "
                "loss_fn.reference_policy_kl_penalty > 0 (the worker then keeps a frozen copy "
                "of the initial weights)"
            )
        return self.reference_model

    # ------------------------------------------------------------------ split train step

    def _train_microbatches(
        self, batch: TrainBatch, step_num_sequences: int, step_num_tokens: int | None
    ) -> dict[str, float]:
        self._check_length(batch)
        reuse_logprobs = "prev_logprobs" not in batch
        if reuse_logprobs and not self.loss_cfg.reuse_training_logprobs:
            raise KeyError(
                "train batch lacks 'prev_logprobs': pass get_logprobs(batch) as "
                "batch['prev_logprobs'], or set loss_fn.reuse_training_logprobs: true to take "
                "them from the training forward (one optimizer step per batch only)"
            )
        normalizer = self._step.declare(
            step_num_sequences=step_num_sequences,
            step_num_tokens=step_num_tokens,
            num_sequences=int(batch["input_ids"].shape[0]),
        )
        self.model.train()
        batch, _ = sort_rows_by_length(batch)
        # Everything the loop needs is cut and moved up front: the loop itself queues work
        # for the device and never waits on it; the metrics come back in one transfer.
        packed = self._packs(batch)
        micros = [
            self._prepare(micro, loss_mask(micro) > 0, packed)
            for micro in map(trim_padding, self._split(batch, packed))
            if count_loss_tokens(micro) > 0  # the others add exactly 0 to loss and gradient
        ]
        passes = self.replicas.max_int(len(micros))  # before any pass: collectives line up
        entropy_mode = "grad" if self.loss_cfg.entropy_coef > 0 else "metric"
        device_metrics = []
        for micro in micros:
            logprobs, entropy = self._forward(micro, entropy=entropy_mode)
            if reuse_logprobs:
                # Exact: gradients accumulate, the weights change only in finish_train_step.
                micro.batch["prev_logprobs"] = logprobs.detach()
            loss, metrics = policy_loss_terms(
                logprobs,
                micro.batch,
                self.loss_cfg,
                num_step_tokens=normalizer,
                num_step_sequences=step_num_sequences,
                entropy=entropy,
            )
            loss.backward()
            device_metrics.append(metrics)
        self._idle_passes(passes - len(micros), train=True)
        chunk = StepTracker()
        for metrics in metrics_to_floats(device_metrics):
            chunk.add(metrics)
            self._step.add(metrics)
        # Report the chunk's own mean loss (its share of the step is not final while the
        # step's size is still unknown).
        if self.loss_cfg.token_level_loss:
            scale = normalizer / chunk.valid_tokens if chunk.valid_tokens else 1.0
        else:
            scale = step_num_sequences / int(batch["input_ids"].shape[0])
        return chunk.summary(scale)

    def _idle_passes(self, count: int, *, train: bool) -> None:
        """``count`` passes over a 2-token dummy row that add exactly 0 to every gradient: a
        rank with fewer micro-batches than another runs them, so that every rank issues the
        same collectives (none in one process, where ``count`` is always 0)."""
        if count <= 0:
            return
        dummy = {
            "input_ids": torch.zeros((1, 2), dtype=torch.long),
            "attention_mask": torch.ones((1, 2), dtype=torch.long),
        }
        needed = torch.tensor([[False, True]])
        for _ in range(count):
            micro = self._prepare(dummy, needed)
            logprobs, entropy = self._forward(micro, entropy="grad" if train else "none")
            if train:
                zero = logprobs.sum() * 0.0
                if entropy is not None:
                    zero = zero + entropy.sum() * 0.0
                zero.backward()

    def _clip_gradients(self) -> float:
        return grad_norm_and_clip(self.model.parameters(), self.cfg.max_grad_norm)

    def _finish_train_step(self) -> dict[str, float]:
        try:
            # Over every rank: the step's tokens (rows, for a sequence mean) normalise the loss
            # wherever they were trained.
            valid_tokens = self.replicas.sum_int(self._step.valid_tokens)
            sequences = self.replicas.sum_int(self._step.sequences)
            self._step.check_finish(valid_tokens, sequences)
            self._offload.reload()
            lr = float(self.scheduler.get_last_lr()[0])
            scale = self._step.gradient_scale(
                token_level=self.loss_cfg.token_level_loss,
                valid_tokens=valid_tokens,
                sequences=sequences,
            )
            scale_gradients(self.model.parameters(), scale)
            grad_norm = self._clip_gradients()
            self.optimizer.step()
            self.scheduler.step()
        except Exception:
            self.optimizer.zero_grad(set_to_none=True)
            self._step.end()
            raise
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        metrics = self._step.summary(scale)
        self._step.end()
        # CPU seconds this process spent since the previous step's end (the whole step's
        # trainer work, weight export included, when the worker has a process of its own):
        # comparable across runs on a loaded machine, unlike wall-clock times.
        now = time.process_time()
        process_cpu_s, self._process_cpu_mark = now - self._process_cpu_mark, now
        metrics.update(
            {
                "grad_norm": grad_norm,
                "lr": lr,
                "optimizer_steps": float(self.optimizer_steps),
                "process_cpu_s": process_cpu_s,
            }
        )
        return metrics

    # ------------------------------------------------------------------ weights, checkpoints

    def _export_weights(self) -> dict[str, torch.Tensor]:
        # copy=True: an in-process generator must never alias the live training parameters.
        # state_dict() keeps both names of tied parameters (embed_tokens and lm_head), so a
        # generator's load_state_dict(strict=True) finds every key it needs.
        return {
            name: tensor.detach().to("cpu", copy=True).contiguous()
            for name, tensor in self.model.state_dict().items()
        }

    def _load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict, strict=True)

    def _save_checkpoint(self, directory: Path, save_optimizer: bool) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, safe_serialization=True)
        copy_tokenizer_files(self.model_path, directory)
        if save_optimizer:
            save_optimizer_state(directory, self.optimizer, self.scheduler)
        write_worker_state(
            directory,
            {
                "kind": "policy",
                "optimizer_steps": self.optimizer_steps,
                "has_optimizer": save_optimizer,
            },
        )

    async def save_final_model(self, directory: str | os.PathLike[str]) -> str:
        """The trained policy as a transformers model folder; returns its path."""
        return await self._executor.run(self._save_final_model, Path(directory))

    def _save_final_model(self, directory: Path) -> str:
        # Weights, config and generation config (save_pretrained) and the tokenizer files: what
        # from_pretrained, vLLM or another `tandemrl train` (policy.model_name) load. Published
        # by one rename, replacing an earlier run's folder only once this one is whole.
        with atomic_directory(directory) as tmp:
            self.model.save_pretrained(tmp, safe_serialization=True)
            copy_tokenizer_files(self.model_path, tmp)
            mask = os.umask(0)
            os.umask(mask)
            for path in tmp.iterdir():  # safetensors writes its file private (0600)
                path.chmod(0o666 & ~mask)
        return str(directory)

    def _load_checkpoint(self, directory: Path, load_optimizer: bool) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"policy checkpoint folder {directory} does not exist")
        state = read_worker_state(directory)
        if state.get("kind") != "policy":
            raise CheckpointError(
                f"{directory} holds a {state.get('kind')!r} checkpoint, not a policy checkpoint"
            )
        if state.get("layout") == SHARDED_LAYOUT:
            # Written by a sharded trainer (policy.dtensor_cfg.data_parallel_size > 1): DCP
            # reshards it into this one process.
            from tandemrl.training.fsdp import load_sharded_checkpoint

            load_sharded_checkpoint(
                directory,
                self.forward_module,
                self.optimizer if load_optimizer else None,
                self.scheduler,
                rank=self.replicas.rank,
            )
        else:
            self._load_model_weights(directory)
            if load_optimizer:
                load_optimizer_state(directory, self.optimizer, self.scheduler)
        if load_optimizer:
            self._offload.location = "device"
        self.optimizer_steps = int(state["optimizer_steps"])

    def _load_model_weights(self, directory: Path) -> None:
        single = directory / "model.safetensors"
        sharded = directory / "model.safetensors.index.json"
        weights_file = single if single.is_file() else sharded
        if not weights_file.is_file():
            raise CheckpointError(
                f"checkpoint file {single} (or {sharded.name}) is missing in {directory}"
            )
        try:
            # from_pretrained resolves shards and tied weights the way save_pretrained wrote them.
            if self.is_vlm:
                loaded = load_policy_model(directory, dtype=torch.float32, device="cpu")
            else:
                loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            self.model.load_state_dict(loaded.state_dict(), strict=True)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint file {weights_file} is corrupt or does not match the model: {exc}"
            ) from exc

    # ---------------------- the Trainer contract (begin/train/finish/save/load: SplitStepWorkerAPI)

    async def get_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] logprobs of ``input_ids`` under the current weights (no grad), on CPU."""
        return await self._executor.run(self._get_logprobs, batch)

    async def get_reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] logprobs of ``input_ids`` under the frozen reference policy, on CPU."""
        return await self._executor.run(self._get_logprobs, batch, True)

    async def export_weights(self) -> dict[str, torch.Tensor]:
        """CPU float32 state dict (contiguous copies, every key incl. tied lm_head.weight)."""
        return await self._executor.run(self._export_weights)

    async def export_weights_flat(self) -> FlatWeights:
        """The same weights packed in one float32 buffer (for Ray's object store)."""
        return await self._executor.run(lambda: FlatWeights.pack(self.model.state_dict()))

    async def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        await self._executor.run(self._load_weights, state_dict)

    # Device weight sync (CUDA IPC, NCCL): the sender methods come from WeightSenderHost;
    # staging reads the parameters on the serial executor, like every other use of the model.

    def _weight_sync_model(self) -> torch.nn.Module:
        return self.model

    async def _weight_sync_run(self, fn: Any, *args: Any) -> Any:
        return await self._executor.run(fn, *args)

    async def offload_optimizer(self) -> None:
        await self._executor.run(self._offload.offload)

    async def reload_optimizer(self) -> None:
        await self._executor.run(self._offload.reload)


def create_policy_worker_actor(
    policy_cfg: PolicyConfig,
    loss_cfg: LossConfig,
    *,
    model_path: str | os.PathLike[str] | None = None,
    seed: int = 0,
    num_cpus: float = 1,
    num_gpus: float = 0,
    torch_num_threads: int | None = 1,
    **actor_options: Any,
) -> Any:
    """Start a ``PolicyWorker`` as a Ray actor (an async actor: methods are awaited remotely).

    ``actor_options`` go to ``.options()`` (name, namespace, lifetime, ...). Returns the
    actor handle; call methods as ``await handle.train_microbatches.remote(...)``.
    """
    import ray

    actor_class = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(PolicyWorker)
    if actor_options:
        actor_class = actor_class.options(**actor_options)
    return actor_class.remote(
        policy_cfg,
        loss_cfg,
        model_path=None if model_path is None else str(model_path),
        seed=seed,
        torch_num_threads=torch_num_threads,
    )
