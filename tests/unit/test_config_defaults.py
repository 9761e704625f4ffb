"""Defaults agree with each other: a minimal config is valid and means the same however written.

And ``tandemrl validate --print`` output validates and loads back as the same run, for every
exemplar (an explicitly written default must not be read as a different choice).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tandemrl.cli import main
from tandemrl.config import check_config, load_config, validate_single_controller_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXEMPLARS = sorted(
    [*(EXAMPLES / "configs").glob("*.yaml"), EXAMPLES / "custom_env" / "config.yaml"]
)


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_minimal_grpo_config_is_valid(tmp_path):
    cfg = load_config(write(tmp_path, "grpo: {}\n"))
    assert validate_single_controller_config(cfg) == []
    # The default sampler admits data one version old, so correction is on by default.
    assert cfg.async_rl.sampler.max_lookahead_versions == 1
    assert cfg.loss_fn.use_importance_sampling_correction is True


def test_setting_only_the_step_size_is_valid(tmp_path):
    path = write(
        tmp_path, "grpo: {num_prompts_per_step: 8}\npolicy: {train_global_batch_size: 64}\n"
    )
    cfg = load_config(path)
    assert validate_single_controller_config(cfg) == []
    async_rl = cfg.async_rl
    assert async_rl.min_groups_for_streaming_train == 8
    assert (async_rl.max_buffered_rollouts, async_rl.max_inflight_prompts) == (16, 16)


@pytest.mark.parametrize(
    "sampler",
    [
        "",
        "async_rl: {sampler: {name: in_order}}\n",
        "async_rl: {sampler: {name: in_order, max_lookahead_versions: 1}}\n",
        "async_rl:\n  sampler: {name: in_order, max_lookahead_versions: 1}\n"
        "  min_groups_for_streaming_train: 16\n  max_buffered_rollouts: 32\n"
        "  max_inflight_prompts: 32\nloss_fn: {use_importance_sampling_correction: true}\n",
        "async_rl: {min_groups_for_streaming_train: null, max_buffered_rollouts: null}\n",
    ],
    ids=["no-block", "name-only", "lookahead-1", "all-spelled-out", "nulls"],
)
def test_the_minimal_config_means_the_same_however_it_is_written(tmp_path, sampler):
    minimal = load_config(write(tmp_path, "grpo: {}\n", "minimal.yaml"))
    written = load_config(write(tmp_path, "grpo: {}\n" + sampler))
    assert written == minimal


def test_derived_defaults_follow_the_sampler(tmp_path):
    sync = load_config(
        write(
            tmp_path, "grpo: {}\nasync_rl: {sampler: {name: in_order, max_lookahead_versions: 0}}\n"
        )
    )
    assert sync.loss_fn.use_importance_sampling_correction is False
    assert (sync.async_rl.max_buffered_rollouts, sync.async_rl.max_inflight_prompts) == (16, 16)
    assert validate_single_controller_config(sync) == []
    windowed = load_config(
        write(
            tmp_path, "grpo: {}\nasync_rl: {sampler: {name: windowed, max_staleness_versions: 2}}\n"
        )
    )
    assert windowed.loss_fn.use_importance_sampling_correction is True
    assert windowed.async_rl.max_buffered_rollouts == 48
    assert validate_single_controller_config(windowed) == []
    # A value written by the user always wins over the derived one.
    explicit = load_config(
        write(tmp_path, "grpo: {}\nloss_fn: {use_importance_sampling_correction: false}\n")
    )
    assert explicit.loss_fn.use_importance_sampling_correction is False


@pytest.mark.parametrize("path", EXEMPLARS, ids=lambda path: path.stem)
def test_validate_print_output_validates_and_loads_back_as_the_same_run(path, tmp_path, capsys):
    # The config round trip, not this machine: the GPU exemplar names a folder made there.
    assert main(["validate", "--config", str(path), "--print", "--no-runtime-checks"]) == 0
    printed = capsys.readouterr().out
    again = write(tmp_path, printed, "printed.yaml")
    report = check_config(again)
    assert report.errors == [], report.errors
    assert report.config == load_config(path)
    # And printing the printed config changes nothing.
    assert main(["validate", "--config", str(again), "--print", "--no-runtime-checks"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == yaml.safe_load(printed)
