"""Rollouts: one prompt group from dispatch to a committed, training-ready buffer slot.

- ``manager``: ``RolloutManager`` reserves a group's slot, generates, scores, retries, and
  writes and commits its rows.
- ``generation_pool``: routes generation calls over the workers, with awake-time deadlines.
- ``ledger``: the ownership ledger of unfinished groups and their staged siblings.
- ``failures``: failure classes, backoff and drop budgets.
- ``events``: the ownership events the pumps report (implemented by the checkpoint package).
"""
