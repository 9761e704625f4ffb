"""The tandemrl command: validate exit codes and output, overrides, lazy train/inspect wiring."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from tandemrl.cli import main
from tandemrl.config import MasterConfig, load_config

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml")


def test_validate_valid_config_exits_zero(capsys):
    assert main(["validate", "--config", DEFAULT]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"{DEFAULT}: valid"
    assert err == ""


def test_validate_invalid_config_exits_two_with_one_line_per_problem(capsys):
    code = main(
        [
            "validate",
            "--config",
            DEFAULT,
            "data_plane.enabled=false",
            "loss_fn.use_importance_sampling_correction=false",
        ]
    )
    assert code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert lines[0] == f"{DEFAULT}: invalid config"
    assert len(lines) == 3
    assert lines[1].startswith("data_plane.enabled:")
    assert lines[2].startswith("loss_fn.use_importance_sampling_correction:")


def test_validate_reports_load_errors_with_exit_two(capsys, tmp_path):
    assert main(["validate", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["validate", "--config", DEFAULT, "grpo.num_prompts_per_stp=4"]) == 2
    assert "did you mean num_prompts_per_step?" in capsys.readouterr().err


def test_validate_prints_warnings_and_still_exits_zero(capsys):
    code = main(["validate", "--config", DEFAULT, "checkpointing.save_data_plane=true"])
    assert code == 0
    out, err = capsys.readouterr()
    assert "valid" in out
    assert err.startswith("warning: checkpointing.save_data_plane:")


def test_validate_print_emits_the_resolved_config(capsys, tmp_path):
    code = main(
        [
            "validate",
            "--config",
            DEFAULT,
            "--print",
            "grpo.num_prompts_per_step=8",
            "policy.train_global_batch_size=64",
        ]
    )
    assert code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    # The override flowed through ${grpo.num_prompts_per_step}.
    assert printed["async_rl"]["min_groups_for_streaming_train"] == 8
    path = tmp_path / "printed.yaml"
    path.write_text(yaml.safe_dump(printed))
    expected = load_config(
        DEFAULT, ["grpo.num_prompts_per_step=8", "policy.train_global_batch_size=64"]
    )
    assert load_config(path) == expected


def test_overrides_may_come_before_and_after_options(capsys):
    argv = [
        "validate",
        "grpo.max_num_steps=7",
        "--config",
        DEFAULT,
        "grpo.seed=5",
        "--print",
        "logger.log_dir=runs/cli",
    ]
    assert main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["grpo"]["max_num_steps"] == 7
    assert printed["grpo"]["seed"] == 5
    assert printed["logger"]["log_dir"] == "runs/cli"


def test_unknown_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["validate", "--config", DEFAULT, "--bogus"])
    assert info.value.code == 2
    assert "--bogus" in capsys.readouterr().err


def test_inspect_takes_no_overrides(capsys):
    with pytest.raises(SystemExit) as info:
        main(["inspect", "somewhere", "a.b=1"])
    assert info.value.code == 2


def fake_module(monkeypatch, name: str, **attributes) -> None:
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def test_train_validates_then_calls_run_training(monkeypatch):
    received: list[MasterConfig] = []
    fake_module(
        monkeypatch,
        "tandemrl.controller.run",
        run_training=lambda cfg, **options: received.append(cfg),
    )
    assert main(["train", "--config", DEFAULT, "grpo.max_num_steps=3"]) == 0
    (cfg,) = received
    assert cfg.grpo.max_num_steps == 3


def test_train_passes_on_an_integer_exit_code(monkeypatch):
    fake_module(monkeypatch, "tandemrl.controller.run", run_training=lambda cfg, **options: 4)
    assert main(["train", "--config", DEFAULT]) == 4


def test_train_refuses_an_invalid_config_before_starting(monkeypatch, capsys):
    received: list[MasterConfig] = []
    fake_module(
        monkeypatch,
        "tandemrl.controller.run",
        run_training=lambda cfg, **options: received.append(cfg),
    )
    assert main(["train", "--config", DEFAULT, "data_plane.enabled=false"]) == 2
    assert received == []
    assert "data_plane.enabled" in capsys.readouterr().err


def test_train_says_which_part_is_not_built(monkeypatch, capsys):
    # A None entry makes the import fail with ModuleNotFoundError for exactly that module.
    monkeypatch.setitem(sys.modules, "tandemrl.controller.run", None)
    assert main(["train", "--config", DEFAULT]) == 2
    err = capsys.readouterr().err
    assert "training controller" in err and "not built yet" in err
    assert "Traceback" not in err


def test_inspect_returns_the_commands_exit_code(monkeypatch):
    seen: list[str] = []

    def inspect_command(path: str) -> int:
        seen.append(path)
        return 3

    fake_module(monkeypatch, "tandemrl.checkpoint.inspect", inspect_command=inspect_command)
    assert main(["inspect", "checkpoints/run"]) == 3
    assert seen == ["checkpoints/run"]


def test_inspect_says_when_it_is_not_built(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tandemrl.checkpoint.inspect", None)
    assert main(["inspect", "checkpoints/run"]) == 2
    assert "checkpoint inspection" in capsys.readouterr().err


def test_module_entry_point_exit_codes():
    def run(*args: str) -> int:
        command = [sys.executable, "-m", "tandemrl.cli", "validate", "--config", DEFAULT, *args]
        return subprocess.run(command, capture_output=True, cwd=REPO, check=False).returncode

    assert run() == 0
    assert run("data_plane.enabled=false") == 2
