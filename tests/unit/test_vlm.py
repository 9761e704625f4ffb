"""Vision-language GRPO (policy.is_vlm): the tiny Qwen2-VL preset, its processor, images in
rows, the engine and the trainer on the same logprobs, data failures of bad images, the data
plane and the config rules. docs/vlm.md is the page these tests hold the code to."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import load_config
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.controller.actor import run_text_codec
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import DatasetError, load_prompt_records
from tandemrl.data.images import ImageError, row_images
from tandemrl.data.shapes import draw_squares, png_data_uri
from tandemrl.dataplane.local import LocalDataPlane
from tandemrl.dataplane.rows import make_group_block
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.models import TINY_PRESETS, resolve_model_path
from tandemrl.models.vision import image_embeddings, load_processor, load_vision_lm
from tandemrl.preflight import runtime_problems
from tandemrl.records import GenerationRequest
from tandemrl.training.batch import collate_rows, multimodal_inputs
from tandemrl.training.fake import FakeTrainer
from tandemrl.training.policy_worker import PolicyWorker

EXEMPLAR = "examples/configs/grpo_tiny_cpu_vlm.yaml"
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_path("tiny://qwen2-vl", tmp_path_factory.mktemp("vlm-models"))


def squares_image(count: int, seed: int = 0) -> Image.Image:
    import random

    return draw_squares(random.Random(seed), count)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def vlm_cfg(*overrides: str):
    return load_config(
        EXEMPLAR,
        (
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=4",
            "async_rl.max_buffered_rollouts=8",
            "async_rl.max_inflight_prompts=8",
            "logger.progress=false",
            *overrides,
        ),
    )


# ---------------------------------------------------------------- preset, processor


def test_processor_round_trip(model_dir: Path) -> None:
    """The preset folder (written by save_pretrained) loads through from_pretrained; its
    processor gives the pixels of the in-memory image processor and one placeholder token per
    merged patch; the model consumes both."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = load_processor(model_dir)
    preset = TINY_PRESETS["qwen2-vl"]
    image = squares_image(3)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "squares="}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>")
    out = processor(text=[text], images=[image], return_tensors="pt")
    direct = Qwen2VLImageProcessorPil(**preset.image_processor)(images=[image], return_tensors="pt")
    # Equal to float32 rounding: on the H200 image (transformers 5.17, torchvision installed)
    # the processor loaded from the folder gave pixels up to 2.4e-7 off the PIL processor's.
    torch.testing.assert_close(out["pixel_values"], direct["pixel_values"], atol=1e-6, rtol=0)
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]  # 28 x 28 in 7-pixel patches
    model = load_vision_lm(model_dir, torch.float32, torch.device("cpu"))
    image_id = model.config.image_token_id
    assert int((out["input_ids"] == image_id).sum()) == 16 // 4  # merged 2 x 2
    assert processor.tokenizer.decode(out["input_ids"][0]).endswith("<|im_start|>assistant\n")
    logits = model(**{k: v for k, v in out.items()}).logits
    assert logits.shape == (1, out["input_ids"].shape[1], len(processor.tokenizer))


def test_row_images_read_every_form_and_name_each_problem(tmp_path: Path) -> None:
    image = squares_image(2)
    (tmp_path / "a.png").write_bytes(png_bytes(image))
    pixels = np.asarray(image)
    forms = [
        "a.png",  # relative to the dataset's folder
        png_data_uri(image),
        {"bytes": base64.b64encode(png_bytes(image)).decode()},
        pixels.tolist(),
    ]
    for form in forms:
        [decoded] = row_images(form, field="image", base_dir=tmp_path, max_pixels=10_000)
        assert np.array_equal(np.asarray(decoded.convert("RGB")), pixels), form
    assert (
        len(
            row_images(
                ["a.png", png_data_uri(image)], field="i", base_dir=tmp_path, max_pixels=10_000
            )
        )
        == 2
    )
    truncated = {"bytes": base64.b64encode(png_bytes(image)[:60]).decode()}
    problems = {
        "no such image file": "missing.png",
        "not an image Pillow can read": {"bytes": base64.b64encode(b"not a png").decode()},
        "corrupt": truncated,
        "not valid base64": {"bytes": "%%%"},
        "over data.max_image_pixels=100": "a.png",
        "must be 0-255": [[300, 1], [2, 3]],
        "[height, width] or": [1, 2, 3],
    }
    for message, value in problems.items():
        with pytest.raises(ImageError, match=message.replace("[", r"\[")):
            limit = 100 if "max_image_pixels" in message else 10_000
            row_images(value, field="image", base_dir=tmp_path, max_pixels=limit)


# ---------------------------------------------------------------- engine and trainer


def test_engine_logprobs_of_vlm_rows_equal_the_trainers(model_dir: Path) -> None:
    """Image prompts through the engine (vision encoder at prefill, 3-D positions at every
    decode step, a cache rebuild after a weight update in between), then the rows through the
    trainer: the same logprob at every generated token."""
    cfg = vlm_cfg()
    codec = run_text_codec(cfg, str(model_dir))
    loader = PromptDataLoader.from_config(cfg.data, max_num_epochs=1, images=True)
    items = loader.take(3)
    engine = TorchGenerationEngine(
        model_dir, device="cpu", max_batch_size=8, recompute_kv_cache_after_weight_updates=True
    )
    worker = PolicyWorker(cfg.policy, cfg.loss_fn, model_path=model_dir, seed=0)
    encoded = [codec.encode_prompt_inputs(item) for item in items]
    weights = asyncio.run(worker.export_weights())

    async def run():
        requests = [
            GenerationRequest(f"r{i}/{s}", ids, 6, 1.0, 1.0, (), seed=10 * i + s, image_inputs=inp)
            for i, (ids, inp) in enumerate(encoded)
            for s in range(2)
        ]
        task = asyncio.ensure_future(engine.generate(requests))
        while engine.stats.admissions == 0:  # admitted: the first prefill is under way
            await asyncio.sleep(0.001)
        # A weight update while the requests decode: the cache is rebuilt from tokens and
        # images with the same (unchanged) weights, so nothing may move.
        await engine.update_weights(1, weights)
        try:
            return await task
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    blocks = []
    for index, (_ids, image_inputs) in enumerate(encoded):
        pair = results[2 * index : 2 * index + 2]
        blocks.append(
            make_group_block(
                [f"g{index}/0", f"g{index}/1"],
                pair[0].prompt_token_ids,
                [r.token_ids for r in pair],
                [r.logprobs for r in pair],
                [0.0, 1.0],
                [1.0, 1.0],
                image_inputs=image_inputs,
            )
        )
    rows = [row for block in blocks for row in block.row_views()]
    batch = collate_rows(rows, pad_token_id=0)
    assert multimodal_inputs(batch)["image_grid_thw"].shape == (6, 3)
    trainer = asyncio.run(worker.get_logprobs(batch))
    mask = batch["token_mask"] > 0
    torch.testing.assert_close(
        trainer[mask], batch["generation_logprobs"][mask], atol=LOGPROB_ATOL, rtol=0
    )
    assert engine.stats.kv_recomputes == 1 and engine.stats.weight_updates == 1


def test_a_generated_placeholder_token_is_text_not_an_image_slot(model_dir: Path) -> None:
    """A completion may sample <|image_pad|>: it is embedded as a token; only the prompt's
    placeholders take image features."""
    model = load_vision_lm(model_dir, torch.float32, torch.device("cpu"))
    processor = load_processor(model_dir)
    out = processor(text=["<|image_pad|>squares="], images=[squares_image(1)], return_tensors="pt")
    image_id = model.config.image_token_id
    input_ids = torch.cat([out["input_ids"], torch.tensor([[image_id, 5]])], dim=1)
    prompt_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    prompt_mask[:, : out["input_ids"].shape[1]] = True
    embeds = image_embeddings(
        model, input_ids, prompt_mask, out["pixel_values"], out["image_grid_thw"]
    )
    plain = model.get_input_embeddings()(input_ids)
    torch.testing.assert_close(embeds[0, -2], plain[0, -2], atol=0, rtol=0)
    assert not torch.equal(embeds[0, 0], plain[0, 0])


def test_sync_vlm_grpo_has_importance_weight_one(model_dir: Path) -> None:
    """Two on-policy GRPO steps on images, a weight sync between them: the trainer's logprobs
    are the generator's at every step."""
    cfg = vlm_cfg(
        f"policy.model_name={model_dir}",
        "async_rl.sampler.max_lookahead_versions=0",
        "loss_fn.use_importance_sampling_correction=false",
        "grpo.max_num_steps=2",
        "async_rl.max_buffered_rollouts=4",
        "async_rl.max_inflight_prompts=4",
    )
    worker = PolicyWorker(cfg.policy, cfg.loss_fn, seed=0)
    engine = TorchGenerationEngine(model_dir, device="cpu", max_batch_size=8, seed=0)
    codec = run_text_codec(cfg, str(model_dir))
    parts = ControllerParts(trainer=worker, engines=[engine], env=CountingEnv(), codec=codec)

    async def run():
        try:
            return await asyncio.wait_for(build_controller(cfg, parts).run(), timeout=120)
        finally:
            await engine.shutdown()

    history = asyncio.run(run())
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert row["staleness_max"] == 0
        assert abs(row["train/is_weight_max"] - 1.0) < 1e-4, row
        assert abs(row["train/kl_gen_trainer"]) < 1e-6, row
    assert worker.optimizer_steps == 2


# ---------------------------------------------------------------- data failures, data plane


def write_dataset(folder: Path, rows: list[dict]) -> Path:
    path = folder / "images.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_corrupt_image_is_a_data_failure_of_its_prompt_and_the_run_goes_on(
    model_dir: Path, tmp_path: Path
) -> None:
    good = squares_image(2)
    (tmp_path / "good.png").write_bytes(png_bytes(good))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    rows = [{"prompt": "squares=", "answer": "2", "image": "good.png"} for _ in range(6)]
    rows[1]["image"] = "broken.png"
    rows[4]["image"] = {"bytes": base64.b64encode(png_bytes(good)[:70]).decode()}  # truncated
    dataset = write_dataset(tmp_path, rows)
    cfg = vlm_cfg(
        f"policy.model_name={model_dir}",
        f"data.dataset={dataset}",
        "data.shuffle=false",
        "grpo.num_prompts_per_step=2",
        "policy.train_global_batch_size=4",
        "grpo.max_num_steps=2",
        "grpo.max_num_epochs=1",
        "async_rl.sampler.max_lookahead_versions=0",
        "async_rl.max_buffered_rollouts=2",
        "async_rl.max_inflight_prompts=2",
        "async_rl.min_groups_for_streaming_train=2",
        "async_rl.rollout_failure.max_skipped_prompts=2",
        "async_rl.rollout_failure.max_consecutive_dropped_prompts=2",
        "async_rl.rollout_failure.on_dropped_prompt=replace",
        "async_rl.rollout_failure.replacement_reserve_size=2",
    )
    trainer = FakeTrainer()
    parts = ControllerParts(
        trainer=trainer,
        engines=[FakeGenerationBackend(seed=0, vocab_size=80)],
        env=CountingEnv(),
        codec=run_text_codec(cfg, str(model_dir)),
    )
    controller = build_controller(cfg, parts)
    history = asyncio.run(asyncio.wait_for(controller.run(), timeout=60))
    assert [row["step"] for row in history] == [1, 2]
    failures = controller.rollout_manager.budgets.failures
    causes = sorted(f.cause for f in failures)
    assert [f.prompt_id for f in sorted(failures, key=lambda f: f.prompt_id)] == ["e0-i1", "e0-i4"]
    assert "data.dataset row 1" in causes[0] and "broken.png" in causes[0], causes
    assert "data.dataset row 4" in causes[1] and "corrupt" in causes[1], causes
    trained = [group.group_id for _, group in controller.trained_groups]
    assert sorted(trained) == ["e0-i0", "e0-i2", "e0-i3", "e0-i5"]
    chunk = trainer.steps[0].chunks[0]
    assert chunk["mm.pixel_values"].shape == (4, 16, 294)  # the images reached the trainer


def test_vlm_rows_survive_a_data_plane_snapshot(model_dir: Path, tmp_path: Path) -> None:
    processor = load_processor(model_dir)
    out = processor(text=["squares="], images=[squares_image(4)], return_tensors="pt")
    inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    ids = out["input_ids"][0].tolist()
    block = make_group_block(
        ["g/0", "g/1"],
        ids,
        [[5], [6, 7]],
        [[-1.0], [-2.0, -3.0]],
        [1.0, 0.0],
        [1.0, 1.0],
        image_inputs=inputs,
    )

    async def round_trip():
        plane = LocalDataPlane()
        await plane.put_block(block)
        digests = await plane.save(tmp_path / "snap")
        restored = LocalDataPlane()
        assert await restored.load(tmp_path / "snap") == digests
        return await plane.get(["g/0", "g/1"]), await restored.get(["g/0", "g/1"])

    before, after = asyncio.run(round_trip())
    batch_before = collate_rows(list(before.values()), 0)
    batch_after = collate_rows(list(after.values()), 0)  # plain rows, not blocks
    assert batch_before.keys() == batch_after.keys()
    for key in batch_before:
        torch.testing.assert_close(batch_before[key], batch_after[key], atol=0, rtol=0)
    assert batch_after["mm.image_grid_thw"].dtype == torch.long


# ---------------------------------------------------------------- config rules, preflight


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("policy.generation.backend=vllm",), "policy.is_vlm: true with policy.generation.backend"),
        (("policy.sequence_packing=on",), "policy.sequence_packing: on cannot pack"),
        (("policy.model_name=tiny://qwen2-counting",), "is a text-only preset"),
        (("data.dataset=builtin://counting",), "holds no images"),
        (("policy.tokenizer.name=tiny://qwen2-counting",), "policy.tokenizer.name="),
        (
            ("grpo.val_period=1", "data.validation=builtin://shape-colour"),
            "policy.is_vlm: true with validation passes",
        ),
        (("policy.is_vlm=false",), "is a vision-language preset"),
        (
            ("policy.is_vlm=false", "policy.model_name=tiny://qwen2-counting"),
            "data.dataset='builtin://shape-colour' holds images",
        ),
        (
            (
                "policy.is_vlm=false",
                "policy.model_name=tiny://qwen2-counting",
                "data.dataset=builtin://counting",
                "data.image_key=picture",
            ),
            "data.image_key: applies",
        ),
    ],
)
def test_vision_config_rules_name_the_dotpath(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_single_controller_config(vlm_cfg(*overrides))


def test_the_exemplar_is_valid() -> None:
    assert validate_single_controller_config(load_config(EXEMPLAR, ())) == []


def test_preflight_refuses_folders_and_rows_that_do_not_fit(
    model_dir: Path, tmp_path: Path
) -> None:
    text_dir = tmp_path / "text-model"  # what a text-only save_pretrained folder shows
    text_dir.mkdir()
    (text_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (text_dir / "model.safetensors").write_bytes(b"")
    (text_dir / "tokenizer.json").write_text("{}")
    rows = [{"prompt": "squares=", "answer": "1", "image": "a.png"}, {"prompt": "x", "answer": "1"}]
    dataset = write_dataset(tmp_path, rows)
    problems = runtime_problems(vlm_cfg(f"policy.model_name={text_dir}"))
    assert any(
        "policy.is_vlm: true, but policy.model_name=" in p and "text-only" in p for p in problems
    ), problems
    problems = runtime_problems(
        vlm_cfg(
            f"policy.model_name={model_dir}",
            "policy.is_vlm=false",
            "data.dataset=builtin://counting",
        )
    )
    assert any("is a vision-language model" in p for p in problems), problems
    problems = runtime_problems(
        vlm_cfg(f"policy.model_name={model_dir}", f"data.dataset={dataset}")
    )
    assert any(f"{dataset}:2: missing field 'image' (data.image_key)" in p for p in problems)
    with pytest.raises(DatasetError, match="holds no images"):
        load_prompt_records(
            vlm_cfg().data.model_copy(update={"dataset": "builtin://math"}), images=True
        )


def test_vlm_rows_survive_the_simple_data_planes_wire_encoding(model_dir: Path) -> None:
    """data_plane.backend: simple puts rows through TransferQueue batches: image tensors of
    different sizes per row come back with their shapes and dtypes."""
    tq_rows = pytest.importorskip("tandemrl.dataplane.tq_rows")
    pytest.importorskip("tensordict")
    processor = load_processor(model_dir)
    rows = {}
    for index, count in enumerate((1, 2)):  # one image, then two: 16 and 32 patches
        images = [squares_image(2)] * count
        out = processor(
            text=["<|image_pad|>" * count + "colour="], images=images, return_tensors="pt"
        )
        inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        block = make_group_block(
            [f"g{index}/0"],
            out["input_ids"][0].tolist(),
            [[5]],
            [[-1.0]],
            [1.0],
            [1.0],
            image_inputs=inputs,
        )
        rows.update(block.rows())
    assert rows["g1/0"]["mm.pixel_values"].shape == (32, 294)
    for group in tq_rows.pack_rows(rows):
        specs = [tq_rows.row_tag(key, rows[key])[tq_rows.TAG_NAME] for key in group.keys]
        fields = [
            {f: (tq_rows.dtype_from_name(d), tuple(s)) for f, (d, s) in spec["fields"].items()}
            for spec in specs
        ]
        for key, row in tq_rows.unpack_rows(group.keys, fields, group.batch).items():
            for name, tensor in rows[key].items():
                assert torch.equal(row[name], tensor), (key, name)
