"""A real two-node Ray cluster on this machine: ``tandemrl train cluster.address=...`` with the
controller, the generation worker, the two trainer ranks and the TransferQueue (``simple``)
data plane spread over both nodes, SIGKILLed mid-run and restarted on the same cluster.

The cluster: ``ray start --head`` and ``ray start --address`` (two raylets, one GCS), each
node offering a custom resource of its own (``node_a`` / ``node_b``) and one ``trainer_slot``.
The run pins roles with ``cluster.actor_resources`` and ``data_plane.actor_resources``:

    node_a (head): generation worker, trainer rank 0, TransferQueue controller + storage unit
    node_b:        the controller actor (the data plane's client), trainer rank 1

so the trainer group's gloo traffic, the weight sync (rank 0's object-store reference read by
the generation worker) and every data-plane call cross nodes. One kill: the driver and every
Ray worker process of the job (``ray::*``), shortly after step 1's checkpoint is published; the cluster's GCS and
raylets stay up, and the same command resumes from ``checkpoint_dir``. The journal then proves
that every prompt was trained exactly once (0 lost, 0 duplicated groups).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from chaos_harness import CONFIG, MARKER_ENV, REPO, RunShape, audit

from tandemrl.checkpoint.inspect import describe_checkpoint_dir, render_text

pytestmark = pytest.mark.chaos

RAY = Path(sys.executable).parent / "ray"
SHAPE = RunShape(num_prompts=16, epochs=1, prompts_per_step=4, generations_per_prompt=4)
ATTEMPT_TIMEOUT_S = 420.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def marked_pids(marker: str) -> set[int]:
    needle = f"{MARKER_ENV}={marker}".encode()
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as handle:
                    if needle in handle.read():
                        found.add(int(entry.name))
            except OSError:
                continue
    return found


def is_job_worker(pid: int) -> bool:
    """A Ray worker process (an actor of the job, or an idle worker), not a part of the
    cluster: the raylet's command line names default_worker.py too (as what it starts), and
    each node's agents are titled ``ray::DashboardAgent`` / ``ray::RuntimeEnvAgent``."""
    argv = process_argv(pid)
    if not argv:
        return False
    if argv[0].startswith("ray::"):
        return not argv[0].endswith("Agent")
    return len(argv) > 1 and argv[1].endswith("default_worker.py")


def sigkill(pids: set[int]) -> int:
    killed = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone already: nothing to kill
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


class TwoNodeCluster:
    def __init__(self, root: Path) -> None:
        self.marker = uuid.uuid4().hex
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false",
            # A node's agents may take long to start on a loaded machine; the raylet's default
            # wait for them (about 15 s) ends the node.
            "RAY_agent_register_timeout_ms": "180000",
            "RAY_raylet_start_wait_time_s": "120",
            MARKER_ENV: self.marker,
        }
        # An embedded run earlier in this pytest process sets it to 0 (loopback only, one
        # node); a cluster of two nodes needs Ray's default.
        self.env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        self.temp_dir = Path(f"/tmp/trl_mn_{self.marker[:8]}")  # short: socket paths
        # Both nodes register under this machine's address, where the driver looks for them.
        from ray._private.services import get_node_ip_address

        self.address = f"{get_node_ip_address()}:{free_port()}"
        self.log = root / "cluster.log"

    def _ray(self, *args: str) -> None:
        with open(self.log, "ab") as log:
            subprocess.run(
                [str(RAY), *args], env=self.env, stdout=log, stderr=subprocess.STDOUT, check=True
            )

    def start(self) -> None:
        """Both nodes; tried again from scratch on a loaded machine, where a raylet ends itself
        when its agent processes take longer than its fixed wait (about 15 s) to start."""
        for attempt in range(3):
            try:
                self._start_both()
                return
            except subprocess.CalledProcessError:
                self.stop()
                if attempt == 2:
                    raise
                self.address = f"{self.address.rsplit(':', 1)[0]}:{free_port()}"

    def _start_both(self) -> None:
        # Every port chosen free here: other Ray instances may run on this machine.
        def common() -> list[str]:
            return [
                "--num-cpus=4",
                "--disable-usage-stats",
                # the agent's HTTP port is fixed (52365) unless given: one per node here
                f"--dashboard-agent-listen-port={free_port()}",
            ]

        self._ray(
            "start",
            "--head",
            f"--port={self.address.split(':')[1]}",
            f"--ray-client-server-port={free_port()}",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
            '--resources={"node_a": 100, "trainer_slot": 1}',
            *common(),
        )
        self._ray(
            "start",
            f"--address={self.address}",
            '--resources={"node_b": 100, "trainer_slot": 1}',
            *common(),
        )

    def kill_job(self, driver: subprocess.Popen) -> int:
        """SIGKILL the driver's process group and every Ray worker of this cluster."""
        with contextlib.suppress(ProcessLookupError):  # the group has ended already
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        killed = 1
        deadline = time.monotonic() + 30
        while True:
            workers = {pid for pid in marked_pids(self.marker) if is_job_worker(pid)}
            if not workers or time.monotonic() > deadline:
                return killed
            killed += sigkill(workers)
            time.sleep(0.2)

    def stop(self) -> None:
        """Every process of this cluster (daemons included); other clusters are untouched."""
        for _ in range(50):
            left = marked_pids(self.marker)
            if not left:
                break
            sigkill(left)
            time.sleep(0.1)
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # the cluster's session logs


def train_command(cluster: TwoNodeCluster, workdir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tandemrl.cli",
        "train",
        "--config",
        str(CONFIG),
        *SHAPE.overrides(workdir),
        f"cluster.address={cluster.address}",
        "policy.dtensor_cfg.data_parallel_size=2",
        "cluster.actor_resources.trainer.trainer_slot=1",
        "cluster.actor_resources.controller.node_b=1",
        "cluster.actor_resources.generation.node_a=1",
        "data_plane.backend=simple",
        "data_plane.actor_resources.node_a=1",
    ]


def run_attempt(cluster: TwoNodeCluster, workdir: Path, index: int) -> subprocess.Popen:
    log = open(workdir / f"attempt_{index}.log", "wb")  # noqa: SIM115  # closed with the process
    return subprocess.Popen(
        train_command(cluster, workdir),
        cwd=REPO,
        env=cluster.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def test_a_two_node_run_killed_and_restarted_on_the_same_cluster(tmp_path: Path) -> None:
    started = time.monotonic()
    cluster = TwoNodeCluster(tmp_path)
    try:
        cluster.start()
        checkpoint_dir = tmp_path / "ckpt"
        first = run_attempt(cluster, tmp_path, 0)
        first_started = time.monotonic()
        # The kill: mid-generation, once step 1's trainer checkpoint is published.
        published = checkpoint_dir / "step_1" / "manifest.json"
        while first.poll() is None and not published.exists():
            if time.monotonic() - first_started > ATTEMPT_TIMEOUT_S:
                break
            time.sleep(0.01)
        assert published.exists(), f"no checkpoint in time:\n{tail(tmp_path / 'attempt_0.log')}"
        time.sleep(0.3)
        killed = cluster.kill_job(first)
        # the whole job went: driver, controller, generation, 2 ranks, TransferQueue actors
        assert killed >= 6, killed

        second = run_attempt(cluster, tmp_path, 1)
        try:
            code = second.wait(timeout=ATTEMPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            cluster.kill_job(second)
            raise AssertionError(
                f"the restart did not finish:\n{tail(tmp_path / 'attempt_1.log')}"
            ) from None
        log = (tmp_path / "attempt_1.log").read_text(errors="replace")
        assert code == 0, tail(tmp_path / "attempt_1.log")
        assert "resume after step" in log, log[-3000:]

        proof = audit(checkpoint_dir, SHAPE)
        print(
            "RESULT",
            json.dumps(
                {
                    "killed": killed,
                    **{
                        key: proof[key]
                        for key in ("groups_lost", "groups_duplicated", "resumed_steps", "steps")
                    },
                    "wall_s": round(time.monotonic() - started, 1),
                }
            ),
        )
        assert proof["attempts"] == 2
        assert proof["groups_lost"] == 0, proof
        assert proof["groups_duplicated"] == 0, proof
        assert proof["unexpected_groups"] == [], proof
        assert proof["steps"] == SHAPE.total_steps and proof["step_numbering_continuous"], proof
        assert proof["resumed_steps"][1] > 0, proof  # from a trainer checkpoint, not scratch
        state = json.loads(
            (
                checkpoint_dir / f"step_{SHAPE.total_steps}" / "policy" / "worker_state.json"
            ).read_text()
        )
        assert (state["layout"], state["data_parallel_size"]) == ("dcp", 2)
        # tandemrl inspect shows the sharded layout of the checkpoint a restart would use
        info = describe_checkpoint_dir(checkpoint_dir)
        policy = info["models"]["policy"]
        assert (policy["layout"], policy["data_parallel_size"], policy["missing"]) == ("dcp", 2, [])
        assert policy["shard_files"] == ["__0_0.distcp", "__1_0.distcp"]
        assert "sharded at 2 rank(s)" in render_text(info)
    finally:
        cluster.stop()
