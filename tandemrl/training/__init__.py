"""Training: the trainer contract, batches, advantages, losses, and the policy/value workers.

- ``api``: the ``Trainer`` / ``ValueTrainer`` protocols and the train-batch keys
- ``batch``: ``collate_rows``, ``split_microbatches``, ``count_loss_tokens``
- ``advantages``: ``grpo_advantages`` (+ by group), ``gae``, ``whiten``
- ``losses``: ``policy_loss`` (clipped PG + importance-sampling modes), ``value_loss``,
  ``AllMaskedStepError``
- ``policy_worker`` / ``value_worker``: ``PolicyWorker``, ``ValueWorker`` and their Ray actor
  factories (imported from their modules: they pull in transformers)
"""
