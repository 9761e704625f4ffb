"""The DataPlane contract, run against every backend: ``local`` and ``simple`` (TransferQueue).

The ``simple`` cases need Ray and TransferQueue (marked ``integration``; they share one plane
per module, started once, and clear it after each test). The last section checks the simple
backend's row encoding without Ray.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandemrl.config.models import DataPlaneConfig
from tandemrl.dataplane.base import DataPlane, DataPlaneError, Row, RowBlock

BACKENDS = ["local", pytest.param("simple", marks=pytest.mark.integration)]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def simple_plane(request) -> Iterator[DataPlane]:
    # The test extra installs TransferQueue: a missing package is a broken install, not a skip.
    assert importlib.util.find_spec("transfer_queue") is not None, (
        "pip install -e '.[test]' installs it"
    )
    request.getfixturevalue("ray_session")
    from tandemrl.dataplane.simple import SimpleDataPlane

    plane = SimpleDataPlane(
        DataPlaneConfig(backend="simple", num_storage_units=1, call_timeout_s=60)
    )
    run(plane.start())
    yield plane
    run(plane.close())


@pytest.fixture(params=BACKENDS)
def plane(request) -> Iterator[DataPlane]:
    if request.param == "local":
        from tandemrl.dataplane.local import LocalDataPlane

        yield LocalDataPlane()
        return
    shared = request.getfixturevalue("simple_plane")
    run(shared.clear(run(shared.keys())))
    yield shared
    run(shared.clear(run(shared.keys())))


def sample_rows() -> dict[str, Row]:
    generator = torch.Generator().manual_seed(0)
    return {
        "g0/s0": {
            "input_ids": torch.arange(7, dtype=torch.int64),
            "logprobs": torch.randn(7, generator=generator),
            "reward": torch.tensor(0.75),
            "length": torch.tensor(7),
        },
        "g0/s1": {
            "input_ids": torch.arange(3, dtype=torch.int64) + 100,
            "logprobs": torch.randn(3, generator=generator),
            "reward": torch.tensor(-1.0),
            "length": torch.tensor(3),
        },
        "g0/s2": {
            "input_ids": torch.tensor([], dtype=torch.int64),
            "logprobs": torch.tensor([], dtype=torch.float32),
            "reward": torch.tensor(0.0),
            "length": torch.tensor(0),
        },
        # Another field set and other dtypes in the same put.
        "g1/s0": {
            "hidden": torch.randn(2, 3, generator=generator).to(torch.bfloat16),
            "mask": torch.tensor([[True, False], [False, True]]),
            "values": torch.randn(4, 2, generator=generator, dtype=torch.float64),
        },
    }


def assert_rows_equal(got: dict[str, Row], expected: dict[str, Row]) -> None:
    assert list(got) == list(expected)
    for key, row in expected.items():
        assert sorted(got[key]) == sorted(row), key
        for field, tensor in row.items():
            value = got[key][field]
            assert value.dtype == tensor.dtype, (key, field)
            assert value.shape == tensor.shape, (key, field)
            assert torch.equal(value, tensor), (key, field)


def test_backend_attributes(plane: DataPlane) -> None:
    assert plane.backend_name in {"local", "simple"}
    assert plane.supports_native_save is True


def test_put_get_round_trip_keeps_dtypes_and_shapes(plane: DataPlane) -> None:
    rows = sample_rows()
    run(plane.put(rows))
    got = run(plane.get(list(rows)))
    assert_rows_equal(got, rows)
    assert got["g0/s0"]["reward"].dim() == 0
    assert got["g0/s2"]["input_ids"].shape == (0,)


def test_get_returns_requested_order_and_subset(plane: DataPlane) -> None:
    rows = sample_rows()
    run(plane.put(rows))
    wanted = ["g1/s0", "g0/s1"]
    got = run(plane.get(wanted))
    assert_rows_equal(got, {key: rows[key] for key in wanted})


def test_duplicate_put_is_an_error_and_stores_nothing_of_that_batch(plane: DataPlane) -> None:
    rows = sample_rows()
    run(plane.put({"g0/s0": rows["g0/s0"]}))
    with pytest.raises(DataPlaneError, match="g0/s0"):
        run(plane.put({"g0/s0": rows["g0/s0"], "g0/s1": rows["g0/s1"]}))
    assert run(plane.keys()) == ["g0/s0"]


def test_missing_get_names_the_key(plane: DataPlane) -> None:
    run(plane.put({"present": sample_rows()["g0/s0"]}))
    with pytest.raises(DataPlaneError, match="absent-key"):
        run(plane.get(["present", "absent-key"]))


def test_clear_is_idempotent_and_keys_follow(plane: DataPlane) -> None:
    rows = sample_rows()
    run(plane.put(rows))
    assert sorted(run(plane.keys())) == sorted(rows)
    run(plane.clear(["g0/s0", "never-stored"]))
    run(plane.clear(["g0/s0"]))
    run(plane.clear([]))
    assert sorted(run(plane.keys())) == sorted(set(rows) - {"g0/s0"})
    with pytest.raises(DataPlaneError, match="g0/s0"):
        run(plane.get(["g0/s0"]))
    # A cleared id can be written again.
    run(plane.put({"g0/s0": rows["g0/s1"]}))
    assert_rows_equal(run(plane.get(["g0/s0"])), {"g0/s0": rows["g0/s1"]})


def sample_block() -> RowBlock:
    """A group of three rows of different lengths, stacked (padding is 0)."""
    return RowBlock(
        ["b0/s0", "b0/s1", "b0/s2"],
        {
            "input_ids": torch.tensor([[5, 6, 1, 2], [5, 6, 3, 0], [5, 6, 4, 7]]),
            "token_mask": torch.tensor([[0.0, 0, 1, 1], [0, 0, 1, 0], [0, 0, 1, 1]]),
            "reward": torch.tensor([0.5, -1.0, 2.0]),
        },
        [4, 3, 4],
    )


def test_put_block_answers_per_sample_id(plane: DataPlane, tmp_path: Path) -> None:
    block = sample_block()
    run(plane.put_block(block))
    expected = block.rows()
    assert expected["b0/s1"]["input_ids"].tolist() == [5, 6, 3]
    assert expected["b0/s1"]["reward"].shape == ()
    assert sorted(run(plane.keys())) == sorted(expected)
    assert_rows_equal(
        run(plane.get(["b0/s2", "b0/s0"])), {k: expected[k] for k in ["b0/s2", "b0/s0"]}
    )
    with pytest.raises(DataPlaneError, match="b0/s1"):
        run(plane.put({"b0/s1": sample_rows()["g0/s0"]}))
    with pytest.raises(DataPlaneError, match="b0/s0"):
        run(plane.put_block(block))
    # Rows of a block clear one by one, and snapshots hold them like any other row.
    run(plane.clear(["b0/s1"]))
    run(plane.save(tmp_path / "snap"))
    run(plane.clear(run(plane.keys())))
    run(plane.load(tmp_path / "snap"))
    assert_rows_equal(
        run(plane.get(["b0/s0", "b0/s2"])), {k: expected[k] for k in ["b0/s0", "b0/s2"]}
    )


def test_save_load_round_trip(plane: DataPlane, tmp_path: Path) -> None:
    rows = sample_rows()
    run(plane.put(rows))
    digests = run(plane.save(tmp_path / "snap"))
    assert sorted(digests) == sorted(rows)
    assert (tmp_path / "snap" / "manifest.json").is_file()
    # Published atomically: nothing but the snapshot itself is left in the parent.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]

    run(plane.clear(run(plane.keys())))
    assert run(plane.keys()) == []
    assert run(plane.load(tmp_path / "snap")) == digests
    assert_rows_equal(run(plane.get(list(rows))), rows)


def test_save_subset_of_keys(plane: DataPlane, tmp_path: Path) -> None:
    rows = sample_rows()
    run(plane.put(rows))
    digests = run(plane.save(tmp_path / "snap", keys=["g0/s1", "g1/s0"]))
    assert sorted(digests) == ["g0/s1", "g1/s0"]
    run(plane.clear(run(plane.keys())))
    run(plane.load(tmp_path / "snap"))
    assert sorted(run(plane.keys())) == ["g0/s1", "g1/s0"]


def _data_files(snapshot: Path) -> list[Path]:
    manifest = json.loads((snapshot / "manifest.json").read_text())
    return [snapshot / name for name in sorted(manifest["files"])]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_load_of_damaged_snapshot_names_the_file_and_restores_nothing(
    plane: DataPlane, tmp_path: Path, damage: str
) -> None:
    run(plane.put(sample_rows()))
    run(plane.save(tmp_path / "snap"))
    run(plane.clear(run(plane.keys())))
    data_file = _data_files(tmp_path / "snap")[0]
    payload = bytearray(data_file.read_bytes())
    if damage == "flip":
        payload[-1] ^= 0xFF
    else:
        del payload[len(payload) // 2 :]
    data_file.write_bytes(bytes(payload))

    with pytest.raises(DataPlaneError, match=re.escape(data_file.name)):
        run(plane.load(tmp_path / "snap"))
    assert run(plane.keys()) == []


def test_load_without_manifest_is_an_error(plane: DataPlane, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataPlaneError, match=r"manifest\.json"):
        run(plane.load(tmp_path / "empty"))


# --------------------------------------------------------------------------- simple: row encoding


def test_simple_row_encoding_round_trips_without_ray() -> None:
    pytest.importorskip("tensordict")
    from tandemrl.dataplane import tq_rows

    rows = sample_rows()
    for group in tq_rows.pack_rows(rows):
        specs = [tq_rows.tag_fields(tag) for tag in group.tags]
        assert [tq_rows.tag_key(tag) for tag in group.tags] == group.keys
        # TransferQueue hands ragged columns back as jagged nested tensors and equal-shaped
        # ones as dense stacks; both must decode to the original rows.
        unpacked = tq_rows.unpack_rows(group.keys, specs, group.batch)
        assert_rows_equal(unpacked, {key: rows[key] for key in group.keys})
    ragged = next(g for g in tq_rows.pack_rows(rows) if "input_ids" in list(g.batch.keys()))
    assert ragged.batch["input_ids"].is_nested
    assert not ragged.batch["reward"].is_nested


def test_simple_decoded_rows_do_not_keep_the_batch_buffer_alive() -> None:
    pytest.importorskip("tensordict")
    from tandemrl.dataplane import tq_rows

    rows = {f"k{i}": {"x": torch.full((1000,), float(i))} for i in range(4)}
    (group,) = tq_rows.pack_rows(rows)
    specs = [tq_rows.tag_fields(tag) for tag in group.tags]
    unpacked = tq_rows.unpack_rows(group.keys, specs, group.batch)
    for row in unpacked.values():
        assert row["x"].untyped_storage().nbytes() == row["x"].nbytes


def test_simple_row_checks_refuse_bad_rows() -> None:
    pytest.importorskip("tensordict")
    from tandemrl.dataplane import tq_rows

    with pytest.raises(DataPlaneError, match=r"'k'.*'f'"):
        tq_rows.check_row("put", "k", {"f": [1, 2, 3]})
    with pytest.raises(DataPlaneError, match="non-empty str"):
        tq_rows.check_row("put", "", {"f": torch.zeros(1)})
    with pytest.raises(DataPlaneError, match="not supported"):
        tq_rows.check_row("put", "k", {"f": torch.zeros(1, dtype=torch.uint16)})
    with pytest.raises(
        DataPlaneError, match=re.escape("came back as torch.float32, stored as torch.int64")
    ):
        tq_rows.unpack_rows(
            ["k"],
            [{"f": (torch.int64, (2,))}],
            tq_rows.pack_rows({"k": {"f": torch.zeros(2)}})[0].batch,
        )


def test_simple_unstarted_plane_pickles_as_its_config() -> None:
    # The test extra installs TransferQueue: a missing package is a broken install, not a skip.
    assert importlib.util.find_spec("transfer_queue") is not None, (
        "pip install -e '.[test]' installs it"
    )
    from tandemrl.dataplane.simple import SimpleDataPlane

    cfg = DataPlaneConfig(backend="simple", num_storage_units=2, call_timeout_s=5)
    clone = pickle.loads(pickle.dumps(SimpleDataPlane(cfg)))
    assert isinstance(clone, SimpleDataPlane)
    assert clone.cfg == cfg
    assert not clone.started
