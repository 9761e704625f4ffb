"""``env.target``: a user's environment or agent class, imported by name; every way it can be
wrong is an error naming ``env.target`` and what to fix."""

from __future__ import annotations

import pytest

from tandemrl.agents.api import Agent, import_agent_class
from tandemrl.envs import import_environment_class
from tandemrl.envs.base import Environment
from tandemrl.envs.counting import CountingEnv


def test_a_named_environment_class_is_imported() -> None:
    assert import_environment_class("tandemrl.envs.counting:CountingEnv") is CountingEnv
    assert issubclass(CountingEnv, Environment)


@pytest.mark.parametrize(
    ("target", "error", "says"),
    [
        ("tandemrl.envs.counting.CountingEnv", ValueError, "must have the form 'module:ClassName'"),
        ("no_such_module_xyz:Env", ImportError, "list the folder that holds it in env.python_path"),
        ("tandemrl.envs.counting:NoSuchEnv", ImportError, "has no 'NoSuchEnv'"),
        ("tandemrl.envs.counting:positional_match_reward", TypeError, "not a subclass of"),
    ],
)
def test_a_wrong_target_is_refused_naming_env_target(
    target: str, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=r"env\.target=") as raised:
        import_environment_class(target)
    assert says in str(raised.value)


def test_an_environment_is_not_an_agent() -> None:
    with pytest.raises(TypeError, match=r"not a subclass of tandemrl\.agents\.Agent"):
        import_agent_class("tandemrl.envs.counting:CountingEnv")
    assert issubclass(import_agent_class("tandemrl.agents.counting_game:CountingGameAgent"), Agent)
