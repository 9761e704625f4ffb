"""Checkpoints: what a run writes so that a restart loses no finished work, and how it resumes.

- ``writer``: trainer checkpoints at step boundaries and periodic rollout snapshots between them
  (the models, a captured ``RunState``, the data-plane rows of committed groups).
- ``restore``: which bundle a restart resumes (read-only), and re-installing it.
- ``rollout_state``: the sidecar files of a captured run state, written and read back.
- ``commit_log`` / ``commit_replay``: the write-ahead record of ownership changes between
  snapshots, and its replay on top of a bundle.
- ``journal``: the per-run record of what each attempt generated and trained.
- ``layout``, ``fingerprint``, ``inspect``: folder names and manifests, the config identity a
  bundle is compatible with, ``tandemrl inspect``.

Nothing here sees the controller: it is handed the typed parts it reads and writes.
"""
