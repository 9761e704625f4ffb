"""Environments: score one completion of one prompt (reward, keep flag, metadata).

``create_environment(cfg)`` builds the environment that ``env:`` names: the built-in
``counting`` task (the tiny default model learns it), ``math`` (verifiable arithmetic
answers) or ``custom`` (``env.target: "module:ClassName"``, an ``Environment`` subclass),
each constructed with ``env.kwargs``; ``env.python_path`` lists folders to import a custom
environment's module from. The contract an environment implements, and how a slow
or ``async`` scorer keeps the controller's event loop free, is in ``tandemrl.envs.base``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from tandemrl.config.models import EnvConfig
from tandemrl.envs.base import AsyncEnvironment, Environment
from tandemrl.envs.counting import CountingEnv
from tandemrl.envs.math import MathEnv
from tandemrl.targets import import_target_class

BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {"counting": CountingEnv, "math": MathEnv}


def import_environment_class(target: str) -> type[Environment]:
    """Import ``"module:ClassName"`` and check that it is an ``Environment`` subclass."""
    return import_target_class(target, Environment, "tandemrl.envs.base.Environment")


def add_python_path(cfg: EnvConfig) -> list[Path]:
    """Put ``env.python_path`` first on this process's import path; return the directories.

    Runs where the environment is built: in ``tandemrl train`` that is the controller actor,
    a Ray worker whose working directory is the driver's on a local Ray instance (and the
    uploaded ``working_dir`` under ``ray job submit --working-dir``), so a relative entry
    means the same folder there as where the user typed it.
    """
    directories = []
    for index, entry in enumerate(cfg.python_path):
        directory = Path(entry).expanduser().resolve()
        if not directory.is_dir():
            raise FileNotFoundError(
                f"env.python_path[{index}]={entry!r}: no such directory ({directory}, seen "
                f"from {Path.cwd()}); give a folder holding env.target's module"
            )
        directories.append(directory)
    for directory in reversed(directories):  # the first entry ends up first
        if str(directory) in sys.path:
            sys.path.remove(str(directory))
        sys.path.insert(0, str(directory))
    if directories:
        importlib.invalidate_caches()  # a directory made after the first import is searched too
    return directories


def environment_class(cfg: EnvConfig) -> type[Environment]:
    """The class ``env:`` names, imported through ``env.python_path`` for a custom one (a
    check that needs no instance: ``create_environment`` builds one)."""
    if cfg.name in ("agent", "nemo_gym"):
        raise ValueError(
            f"env.name is {cfg.name!r}: the run plays agent episodes and has no Environment "
            "(tandemrl.agents.create_run_agent builds the agent)"
        )
    if cfg.name == "custom":
        if not cfg.target:
            raise ValueError("env.name is 'custom' but env.target is not set ('module:ClassName')")
        add_python_path(cfg)
        return import_environment_class(cfg.target)
    if cfg.target is not None:
        raise ValueError(
            f"env.target={cfg.target!r} is only used with env.name: custom "
            f"(env.name is {cfg.name!r}); remove env.target or set env.name: custom"
        )
    return BUILTIN_ENVIRONMENTS[cfg.name]


def create_environment(cfg: EnvConfig) -> Environment:
    env_class = environment_class(cfg)
    described = f"env.target={cfg.target!r}" if cfg.name == "custom" else f"env.name={cfg.name!r}"
    try:
        env = env_class(**cfg.kwargs)
    except TypeError as error:
        raise TypeError(f"{described}: env.kwargs {cfg.kwargs!r} rejected: {error}") from error
    try:
        env.check_scoring_settings()
    except ValueError as error:
        raise ValueError(f"{described}: {error}") from error
    return env


__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "AsyncEnvironment",
    "CountingEnv",
    "Environment",
    "MathEnv",
    "add_python_path",
    "create_environment",
    "environment_class",
    "import_environment_class",
]
