"""What ``tandemrl validate`` and ``tandemrl train`` check on this machine before anything
starts: each check refuses its broken case (naming the dotpath) and accepts its working one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandemrl.checkpoint.restore import plan_restore
from tandemrl.cli import main
from tandemrl.config.loader import load_config
from tandemrl.controller.run import check_run_can_start, run_already_complete
from tandemrl.metrics.logger import METRICS_FILE
from tandemrl.models import resolve_model_path
from tandemrl.preflight import RunRefused, runtime_problems

DEFAULT = "examples/configs/grpo_tiny_cpu.yaml"


def problems(*overrides: str) -> list[str]:
    return runtime_problems(load_config(DEFAULT, overrides))


def test_the_main_job_has_no_runtime_problem() -> None:
    assert problems() == []


def test_model_folder_checks(tmp_path: Path) -> None:
    (missing,) = problems(f"policy.model_name={tmp_path / 'nope'}")
    assert missing.startswith("policy.model_name=") and "no such folder" in missing
    (hub,) = problems("policy.model_name=Qwen/Qwen2.5-0.5B-Instruct")
    assert "downloads nothing" in hub and "hf download Qwen/Qwen2.5-0.5B-Instruct" in hub
    (unknown,) = problems("policy.model_name=tiny://nope")
    assert "unknown tiny preset 'nope'" in unknown
    empty = tmp_path / "empty"
    empty.mkdir()
    no_config, no_tokenizer = problems(f"policy.model_name={empty}")
    assert "no config.json" in no_config and "holds no tokenizer" in no_tokenizer
    # a real folder (a tiny preset written by save_pretrained) passes
    folder = resolve_model_path("tiny://qwen2-counting")
    assert problems(f"policy.model_name={folder}") == []


def test_dataset_checks(tmp_path: Path) -> None:
    (missing,) = problems(f"data.dataset={tmp_path / 'missing.jsonl'}")
    assert missing.startswith("data.dataset=") and "no such file" in missing
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "x"}\n')
    (bad_line,) = problems(f"data.dataset={broken}")
    assert f"{broken}:2" in bad_line
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert problems(f"data.dataset={good}") == []


def test_env_target_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (missing,) = problems("env.name=custom", "env.target=no_such_module_xyz:Env")
    assert missing.startswith("env.target='no_such_module_xyz:Env'") and "PYTHONPATH" in missing
    (module := tmp_path / "my_env_for_preflight.py").write_text(
        "from tandemrl.envs.base import Environment\n"
        "from tandemrl.records import EnvResult\n"
        "class Env(Environment):\n"
        "    def score(self, item, completion, *, truncated):\n"
        "        return EnvResult(reward=0.0)\n"
        "class NotAnEnv:\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(module.parent))
    assert problems("env.name=custom", "env.target=my_env_for_preflight:Env") == []
    (wrong,) = problems("env.name=custom", "env.target=my_env_for_preflight:NotAnEnv")
    assert "not a subclass" in wrong


def test_cuda_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (message,) = problems("policy.device=cuda")
    assert message.startswith("policy.device: cuda") and "sees no CUDA device" in message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert problems("policy.device=cuda") == []


def test_validate_runs_the_checks_unless_told_not_to(capsys: pytest.CaptureFixture[str]) -> None:
    bad = ["validate", "--config", DEFAULT, "data.dataset=missing.jsonl"]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert "cannot run on this machine" in err and "data.dataset='missing.jsonl'" in err
    assert main([*bad, "--no-runtime-checks"]) == 0


def test_a_used_log_dir_is_refused_for_a_new_run_unless_overwritten(tmp_path: Path) -> None:
    cfg = load_config(DEFAULT, (f"logger.log_dir={tmp_path}",))
    plan = plan_restore(cfg)
    check_run_can_start(cfg, plan, overwrite_logs=False)  # empty folder: fine
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\n')
    with pytest.raises(RunRefused) as refused:
        check_run_can_start(cfg, plan, overwrite_logs=False)
    (message,) = refused.value.problems
    assert message.startswith(f"logger.log_dir='{tmp_path}' already holds another run")
    assert "--overwrite" in message
    check_run_can_start(cfg, plan, overwrite_logs=True)


def test_a_resumed_run_may_use_its_own_log_dir_and_a_finished_one_is_complete(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
        (f"logger.log_dir={tmp_path}", f"checkpointing.checkpoint_dir={ckpt}"),
    )
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\n')
    assert plan_restore(cfg).fresh
    with pytest.raises(RunRefused):
        check_run_can_start(cfg, plan_restore(cfg), overwrite_logs=False)
    # A checkpoint of step 3 makes it this run's folder: resumed, not refused.
    from tandemrl.checkpoint.restore import RestorePlan

    resumed = RestorePlan(ckpt, "latest", trainer_dir=ckpt / "step_3", step=3)
    assert not resumed.fresh
    check_run_can_start(cfg, resumed, overwrite_logs=False)
    assert not run_already_complete(cfg, resumed)
    done = RestorePlan(ckpt, "latest", trainer_dir=ckpt / "step_300", step=300)
    assert run_already_complete(cfg, done)


def test_installed_versions_out_of_range_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    requires = ["torch>=2.11", "transformers<6,>=5.17", "pytest==9.2.0; extra == 'test'"]
    installed = {"torch": "2.11.0+cu130", "transformers": "5.16.0"}

    def version(name: str) -> str:
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "requires", lambda name: requires)
    monkeypatch.setattr(metadata, "version", version)
    from tandemrl.preflight import installed_version_problems

    (message,) = installed_version_problems()
    assert message.startswith("transformers 5.16.0 is installed, but tandemrl needs")
    assert "transformers<6,>=5.17" in message
    installed["transformers"] = "5.17.0"
    assert installed_version_problems() == []  # the test extra's pin does not apply
    del installed["torch"]
    (missing,) = installed_version_problems()
    assert missing.startswith("torch is not installed")
