"""The ``simple`` data plane against real TransferQueue actors in a local Ray session.

TransferQueue's own clients wait forever for a controller or storage unit that died; these
tests kill them and check that every call comes back as a DataPlaneError naming the backend
and the call within ``data_plane.call_timeout_s``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

from tandemrl.config.models import DataPlaneConfig
from tandemrl.dataplane.base import DataPlaneError

pytestmark = pytest.mark.integration

# find_spec, not import: the plane sets TransferQueue's import-time thread settings itself.
# The test extra installs TransferQueue: a missing package is a broken install, not a skip.
assert importlib.util.find_spec("transfer_queue") is not None, (
    "pip install -e '.[test]' installs it"
)

CALL_TIMEOUT_S = 3.0
# Scheduling slack on a loaded 2-core machine, on top of the call timeout.
SLACK_S = 3.0


def run(coro):
    return asyncio.run(coro)


def rows(prefix: str, count: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        f"{prefix}{i}": {"input_ids": torch.arange(i + 1), "reward": torch.tensor(float(i))}
        for i in range(count)
    }


def start_plane():
    from tandemrl.dataplane.simple import SimpleDataPlane

    plane = SimpleDataPlane(
        DataPlaneConfig(backend="simple", num_storage_units=1, call_timeout_s=CALL_TIMEOUT_S)
    )
    run(plane.start())
    return plane


@pytest.fixture(scope="module")
def shared_plane(ray_session) -> Iterator:
    plane = start_plane()
    yield plane
    run(plane.close())


@pytest.fixture
def plane(shared_plane) -> Iterator:
    """The module's healthy plane, emptied after each test."""
    yield shared_plane
    run(shared_plane.clear(run(shared_plane.keys())))


@pytest.fixture
def doomed_plane(ray_session) -> Iterator:
    """A plane of its own, for a test that kills its actors."""
    plane = start_plane()
    yield plane
    run(plane.close())


def kill_process(ray, actor) -> None:
    """SIGKILL the actor's process (as the OOM killer would) and wait until it is gone.

    Not ray.kill: that marks the actor dead at once, but its process (and the ZMQ server
    threads in it) can go on answering for seconds.
    """
    pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still alive 30 s after SIGKILL")


def assert_fails_within_timeout(call: str, coro) -> None:
    started = time.monotonic()
    with pytest.raises(DataPlaneError, match=f"simple data plane {call}.*call_timeout_s"):
        run(coro)
    assert time.monotonic() - started < CALL_TIMEOUT_S + SLACK_S


def test_calls_keep_the_callers_torch_threads_and_report_the_bind_address(plane, ray_session):
    from transfer_queue.utils import common

    from tandemrl.dataplane.simple import tq_thread_count

    # TransferQueue sets torch's thread count to tq_thread_count() around every put/get, then
    # resets it to the count it saw at import. Those calls run on the plane's own I/O thread,
    # so a caller running with any other count keeps it.
    caller_threads = max(common.DEFAULT_TORCH_NUM_THREADS, tq_thread_count()) + 1
    torch.set_num_threads(caller_threads)
    try:
        run(plane.put(rows("r", 3)))
        assert sorted(run(plane.get(["r0", "r2"]))) == ["r0", "r2"]
        assert torch.get_num_threads() == caller_threads
    finally:
        torch.set_num_threads(1)
    # TransferQueue binds its servers to the Ray node's address (loopback only when Ray was
    # started with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; see docs/dataplane.md).
    assert plane.bind_address == ray_session.util.get_node_ip_address()


def test_concurrent_calls_from_one_loop(plane):
    async def pump(prefix: str) -> None:
        batch = rows(prefix, 5)
        await plane.put(batch)
        got = await plane.get(list(batch))
        assert all(torch.equal(got[k]["input_ids"], batch[k]["input_ids"]) for k in batch)
        await plane.clear(list(batch)[:2])

    async def main() -> None:
        await asyncio.gather(*(pump(f"p{i}-") for i in range(8)))

    run(main())
    assert len(run(plane.keys())) == 8 * 3


def test_loads_a_local_backend_snapshot(plane, tmp_path):
    from tandemrl.dataplane.local import LocalDataPlane

    local = LocalDataPlane()
    original = rows("r", 3)
    run(local.put(original))
    digests = run(local.save(tmp_path / "snap"))
    assert run(plane.load(tmp_path / "snap")) == digests
    got = run(plane.get(list(original)))
    for key, row in original.items():
        for field, tensor in row.items():
            assert got[key][field].dtype == tensor.dtype
            assert torch.equal(got[key][field], tensor)


def test_dead_storage_unit_then_dead_controller_fail_within_the_timeout(doomed_plane, ray_session):
    plane = doomed_plane
    run(plane.put(rows("r", 4)))
    (unit_name,) = plane.storage_unit_names
    kill_process(ray_session, plane.actors()[unit_name])

    # The controller still answers lookups; the row payload never comes back.
    assert_fails_within_timeout("get", plane.get(["r1"]))
    assert sorted(run(plane.keys())) == ["r0", "r1", "r2", "r3"]

    kill_process(ray_session, plane.actors()["controller"])
    assert_fails_within_timeout("keys", plane.keys())
    assert_fails_within_timeout("put", plane.put(rows("s", 1)))
    assert_fails_within_timeout("clear", plane.clear(["r0"]))

    started = time.monotonic()
    run(plane.close())
    assert time.monotonic() - started < 15.0
    with pytest.raises(DataPlaneError, match="closed"):
        run(plane.keys())
