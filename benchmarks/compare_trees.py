"""Run one benchmark against two versions of the code, interleaved, in one invocation.

A change's speed is judged against the code before it, measured in the same run (these
machines are noisy, and another process may take a core at any time): the benchmark runs
alternately under the base revision and under this working tree, ``--repeats`` times each,
and the medians of its ``RESULT`` figures are compared.

    python benchmarks/compare_trees.py --base main --repeats 5 -- benchmarks/control_plane.py

The base is exported with ``git archive`` into a temporary folder; each run has that folder
(or this tree) as its working directory and first ``PYTHONPATH`` entry, so ``tandemrl`` and
the benchmark script come from the version being measured. Prints each run's figures, then
``RESULT {json}`` with the medians and the ratio head / base of every numeric figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export_revision(revision: str, target: Path) -> str:
    """Write ``revision``'s files into ``target``; return its commit hash."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{revision}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = target / "base.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", f"--output={archive}", commit],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(target / "tree", filter="data")
    archive.unlink()
    return commit


def run_once(tree: Path, command: list[str]) -> dict[str, float]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, *command], cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} in {tree} exited with {done.returncode}:\n{done.stderr[-3000:]}"
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{' '.join(command)} in {tree} printed no RESULT line")
    result = json.loads(lines[-1][len("RESULT ") :])
    return {key: value for key, value in result.items() if isinstance(value, int | float)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="git revision to compare against")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = parser.parse_args()
    command = [part for part in args.command if part != "--"]
    if not command:
        parser.error("give the benchmark to run after --, e.g. -- benchmarks/control_plane.py")
    with tempfile.TemporaryDirectory(prefix="compare-trees-") as scratch:
        base_commit = export_revision(args.base, Path(scratch))
        trees = {"base": Path(scratch) / "tree", "head": ROOT}
        runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
        for repeat in range(args.repeats):
            # Alternate which goes first, so a drift in the machine's load hits both alike.
            order = ["base", "head"] if repeat % 2 == 0 else ["head", "base"]
            for name in order:
                figures = run_once(trees[name], command)
                runs[name].append(figures)
                print(f"{name} run {repeat + 1}: {json.dumps(figures)}", flush=True)
    medians = {
        name: {key: statistics.median(run[key] for run in results) for key in results[0]}
        for name, results in runs.items()
    }
    ratios = {
        key: round(medians["head"][key] / medians["base"][key], 4)
        for key in medians["base"]
        if key in medians["head"] and medians["base"][key]
    }
    result = {
        "command": " ".join(command),
        "base": args.base,
        "base_commit": base_commit,
        "repeats": args.repeats,
        "base_median": medians["base"],
        "head_median": medians["head"],
        "head_over_base": ratios,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
