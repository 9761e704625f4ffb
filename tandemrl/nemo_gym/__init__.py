"""NeMo-Gym rollouts (``env.name: nemo_gym``): episodes played by Gym's own servers.

TandemRL runs in its own environment; NeMo-Gym (Python >= 3.12, its own pins) runs in a venv
of its own (``venv.py``, ``scripts/install_nemo_gym.sh``), and the two talk HTTP only:

- ``servers.py``: start Gym's servers with Gym's ``RunHelper`` (``gym_side/launch.py``, run by
  the Gym venv's Python) or connect to running ones; their table, liveness probes, stop;
- ``agent.py``: ``GymAgent``, the ``tandemrl.agents.Agent`` whose episode is one ``/run`` of a
  Gym agent server; failures sorted into infrastructure and data;
- ``rows.py``: a dataset row (``tandemrl.data.gym_rows``) as the ``/run`` body, with the
  episode's key where Gym's model server forwards it to the policy endpoint;
- ``resources_servers/``: resources servers of ours, written against Gym's base classes
  (``tandemrl_counting``: the main job's counting task), linked into the Gym venv by the
  install script.

Turns are captured by the policy endpoint like any agent's (``tandemrl.agents``), so the
trainer trains on exactly the ids and logprobs the engine produced. docs/nemo_gym.md.
"""
