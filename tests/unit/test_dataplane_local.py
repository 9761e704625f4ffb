"""LocalDataPlane: put/get/clear/keys, errors, snapshots (round trip, corruption, interruption)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from tandemrl.config.models import DataPlaneConfig
from tandemrl.dataplane import DataPlaneError, LocalDataPlane, atomic, create_data_plane
from tandemrl.dataplane.base import DataPlane, RowBlock
from tandemrl.dataplane.local import MANIFEST_NAME, ROWS_FILE_NAME, row_digest
from tandemrl.dataplane.rows import make_group_block


def run(coro):
    return asyncio.run(coro)


def make_row(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (5 + seed % 3,), generator=gen),
        "logprobs": torch.randn(4, generator=gen).to(torch.bfloat16),
        "reward": torch.tensor(float(seed)),
        "mask": torch.tensor([True, False, seed % 2 == 0]),
    }


def filled_plane(n: int = 4) -> LocalDataPlane:
    plane = LocalDataPlane()
    run(plane.put({f"g{i // 2}-s{i % 2}": make_row(i) for i in range(n)}))
    return plane


def assert_rows_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for field in a:
        assert a[field].dtype == b[field].dtype
        assert torch.equal(a[field], b[field])


def test_put_get_keys_clear() -> None:
    plane = filled_plane()
    assert sorted(run(plane.keys())) == ["g0-s0", "g0-s1", "g1-s0", "g1-s1"]
    got = run(plane.get(["g1-s0", "g0-s1"]))
    assert list(got) == ["g1-s0", "g0-s1"]
    assert_rows_equal(got["g1-s0"], make_row(2))
    run(plane.clear(["g0-s0", "g0-s0", "never-stored"]))  # idempotent, missing ignored
    run(plane.clear(["g0-s0"]))
    assert sorted(run(plane.keys())) == ["g0-s1", "g1-s0", "g1-s1"]
    assert plane.backend_name == "local" and plane.supports_native_save is True


def test_duplicate_put_names_the_key_and_stores_nothing() -> None:
    plane = filled_plane(2)
    with pytest.raises(DataPlaneError, match="g0-s1"):
        run(plane.put({"fresh": make_row(7), "g0-s1": make_row(8)}))
    assert "fresh" not in plane  # the batch was refused as a whole


def test_get_missing_names_the_key() -> None:
    plane = filled_plane(2)
    with pytest.raises(DataPlaneError, match="nope"):
        run(plane.get(["g0-s0", "nope"]))


def test_put_rejects_non_tensor_fields() -> None:
    plane = LocalDataPlane()
    with pytest.raises(DataPlaneError, match="'reward' is float"):
        run(plane.put({"a": {"reward": 1.0}}))
    assert len(plane) == 0


def test_block_rows_are_read_only_views_freed_with_their_last_row() -> None:
    plane = LocalDataPlane()
    block = make_group_block(
        ["g/0", "g/1"], [1, 2], [[3], [4, 5]], [[-0.5], [-1.0, -2.0]], [1, 0], [1, 1]
    )
    run(plane.put_block(block))
    got = run(plane.get(["g/1"]))["g/1"]
    assert got["input_ids"].tolist() == [1, 2, 4, 5]
    assert "reward" in got and len(got) == 5
    with pytest.raises(TypeError):
        got["reward"] = torch.tensor(3.0)  # type: ignore[index]
    assert run(plane.get(["g/1"]))["g/1"]["reward"].item() == 0.0
    run(plane.clear(["g/0", "g/1"]))
    assert len(plane) == 0


class PutRecorder(LocalDataPlane):
    """A local plane that records every ``put``, to see what the default ``put_block`` hands a backend."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[dict[str, dict[str, torch.Tensor]]] = []

    async def put(self, rows):
        self.puts.append(dict(rows))
        await super().put(rows)


def test_default_put_block_puts_the_blocks_rows_as_plain_rows() -> None:
    plane = PutRecorder()
    block = make_group_block(
        ["g/0", "g/1"], [1, 2], [[3, 4], [5]], [[-0.5, -1], [-2]], [1, 0], [1, 1]
    )
    run(DataPlane.put_block(plane, block))  # the base-class default, not the local override
    (rows,) = plane.puts
    assert list(rows) == ["g/0", "g/1"]
    assert all(type(row) is dict for row in rows.values())
    assert rows["g/1"]["input_ids"].tolist() == [1, 2, 5]
    assert rows["g/1"]["generation_logprobs"].tolist() == [0, 0, -2]
    assert rows["g/0"]["reward"].shape == () and rows["g/0"]["reward"].item() == 1.0


def test_row_block_refuses_bad_shapes_and_ids() -> None:
    ids = torch.tensor([[1, 2], [3, 0]])
    with pytest.raises(DataPlaneError, match="'reward' has shape"):
        RowBlock(["a", "b"], {"input_ids": ids, "reward": torch.zeros(3)}, [2, 1])
    with pytest.raises(DataPlaneError, match="has shape"):
        RowBlock(["a", "b"], {"input_ids": ids}, [1, 1])  # width 1, tensor is 2 wide
    with pytest.raises(DataPlaneError, match="distinct non-empty"):
        RowBlock(["a", ""], {"input_ids": ids}, [2, 1])
    with pytest.raises(DataPlaneError, match=r"named torch\.Tensor"):
        RowBlock(["a", "b"], {"input_ids": [[1, 2], [3, 0]]}, [2, 1])  # type: ignore[dict-item]
    with pytest.raises(DataPlaneError, match="length"):
        RowBlock(["a", "b"], {"input_ids": ids}, [2])


def test_save_load_round_trip(tmp_path: Path) -> None:
    plane = filled_plane(6)
    digests = run(plane.save(tmp_path / "dp"))
    assert set(digests) == set(run(plane.keys()))
    restored = LocalDataPlane()
    assert run(restored.load(tmp_path / "dp")) == digests
    for key in run(plane.keys()):
        assert_rows_equal(run(restored.get([key]))[key], run(plane.get([key]))[key])
        assert row_digest(run(restored.get([key]))[key]) == digests[key]
    assert not [p for p in tmp_path.iterdir() if atomic.is_temporary_name(p.name)]


def test_save_subset_and_missing_key(tmp_path: Path) -> None:
    plane = filled_plane(4)
    digests = run(plane.save(tmp_path / "dp", keys=["g1-s1", "g0-s0"]))
    assert set(digests) == {"g1-s1", "g0-s0"}
    restored = LocalDataPlane()
    run(restored.load(tmp_path / "dp"))
    assert sorted(run(restored.keys())) == ["g0-s0", "g1-s1"]
    with pytest.raises(DataPlaneError, match="missing-row"):
        run(plane.save(tmp_path / "dp2", keys=["missing-row"]))
    assert not (tmp_path / "dp2").exists()


def test_save_replaces_existing_snapshot(tmp_path: Path) -> None:
    plane = filled_plane(4)
    run(plane.save(tmp_path / "dp"))
    run(plane.clear(["g0-s0", "g0-s1"]))
    run(plane.save(tmp_path / "dp"))
    restored = LocalDataPlane()
    run(restored.load(tmp_path / "dp"))
    assert sorted(run(restored.keys())) == ["g1-s0", "g1-s1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]


def test_load_refuses_keys_already_stored(tmp_path: Path) -> None:
    plane = filled_plane(2)
    run(plane.save(tmp_path / "dp"))
    with pytest.raises(DataPlaneError, match="already stored"):
        run(plane.load(tmp_path / "dp"))


def test_corrupt_rows_file_is_named(tmp_path: Path) -> None:
    plane = filled_plane(4)
    run(plane.save(tmp_path / "dp"))
    rows_file = tmp_path / "dp" / ROWS_FILE_NAME
    data = bytearray(rows_file.read_bytes())
    data[-3] ^= 0xFF
    rows_file.write_bytes(bytes(data))
    restored = LocalDataPlane()
    with pytest.raises(DataPlaneError, match=f"{ROWS_FILE_NAME} is corrupt"):
        run(restored.load(tmp_path / "dp"))
    assert len(restored) == 0


def test_truncated_rows_file_is_named(tmp_path: Path) -> None:
    plane = filled_plane(4)
    run(plane.save(tmp_path / "dp"))
    rows_file = tmp_path / "dp" / ROWS_FILE_NAME
    rows_file.write_bytes(rows_file.read_bytes()[:-10])
    with pytest.raises(DataPlaneError, match=f"{ROWS_FILE_NAME} is truncated"):
        run(LocalDataPlane().load(tmp_path / "dp"))


def test_corrupt_manifest_is_named(tmp_path: Path) -> None:
    plane = filled_plane(2)
    run(plane.save(tmp_path / "dp"))
    manifest = tmp_path / "dp" / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:20])
    with pytest.raises(DataPlaneError, match=f"{MANIFEST_NAME} is corrupt"):
        run(LocalDataPlane().load(tmp_path / "dp"))


def test_row_digest_mismatch_is_named(tmp_path: Path) -> None:
    plane = filled_plane(2)
    run(plane.save(tmp_path / "dp"))
    manifest_path = tmp_path / "dp" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["rows"]["g0-s1"]["digest"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataPlaneError, match=r"row 'g0-s1'.*does not match its digest"):
        run(LocalDataPlane().load(tmp_path / "dp"))


def test_interrupted_save_is_not_published(tmp_path: Path, monkeypatch) -> None:
    plane = filled_plane(2)
    real_replace = os.replace

    def crash_on_publish(src, dst):
        if Path(dst).name == "dp":
            raise OSError("simulated crash before publish")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", crash_on_publish)
    with pytest.raises(OSError, match="simulated crash"):
        run(plane.save(tmp_path / "dp"))
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    assert not (tmp_path / "dp").exists()
    with pytest.raises(DataPlaneError, match="missing"):
        run(LocalDataPlane().load(tmp_path / "dp"))


def test_failed_replacement_keeps_previous_snapshot(tmp_path: Path, monkeypatch) -> None:
    plane = filled_plane(2)
    run(plane.save(tmp_path / "dp"))
    run(plane.put({"newer": make_row(9)}))
    real_replace = os.replace

    def crash_on_publish(src, dst):
        if Path(dst).name == "dp" and atomic._TMP_MARK in Path(src).name:
            raise OSError("simulated crash while publishing")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", crash_on_publish)
    with pytest.raises(OSError, match="simulated crash"):
        run(plane.save(tmp_path / "dp"))
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    assert sorted(run(LocalDataPlane().load(tmp_path / "dp"))) == ["g0-s0", "g0-s1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]


def test_leftover_tmp_dir_is_refused_and_swept(tmp_path: Path) -> None:
    """A SIGKILL mid-save leaves a complete-looking tmp sibling; it must never be loaded."""
    plane = filled_plane(2)
    run(plane.save(tmp_path / "dp"))
    leftover = tmp_path / ".dp.tmp-deadbeef0000"
    leftover.mkdir()
    for name in (ROWS_FILE_NAME, MANIFEST_NAME):
        (leftover / name).write_bytes((tmp_path / "dp" / name).read_bytes())
    with pytest.raises(DataPlaneError, match="unpublished"):
        run(LocalDataPlane().load(leftover))
    assert atomic.remove_stale_temporaries(tmp_path) == [leftover]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp"]


def test_recover_directory_after_interrupted_replacement(tmp_path: Path) -> None:
    plane = filled_plane(2)
    run(plane.save(tmp_path / "dp"))
    aside = tmp_path / ".dp.old-0123456789ab"
    os.replace(tmp_path / "dp", aside)  # state between the two renames of a replacement
    assert atomic.recover_directory(tmp_path / "dp") is True
    assert sorted(run(LocalDataPlane().load(tmp_path / "dp"))) == ["g0-s0", "g0-s1"]
    assert atomic.recover_directory(tmp_path / "dp") is False


def test_create_data_plane() -> None:
    assert isinstance(create_data_plane(DataPlaneConfig(backend="local")), LocalDataPlane)
    with pytest.raises(DataPlaneError, match=r"data_plane\.backend"):
        create_data_plane(DataPlaneConfig(backend="mooncake"))
