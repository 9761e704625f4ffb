"""How weights travel from the trainer to the generation engines, below both.

``training/`` and ``generation/`` import their side of each transport from here; the
controller's synchronisers (``tandemrl.controller.weight_sync``) only call those sides.

- ``object_store``: ``FlatWeights``, a CPU state dict packed into one buffer for Ray's object
  store (the default transport).
- ``layout``: ``WeightLayout``, where each parameter lives in one flat buffer on the device;
  shared by the CUDA IPC and NCCL transports.
- ``sender``: the trainer's side (``FlatWeightSender``, the ``WeightSenderHost`` mixin).
- ``receiver``: the generation side (``FlatWeightReceiver``, the ``WeightReceiverHost`` mixin).
- ``ipc``: CUDA IPC handles of the trainer's buffer (shared memory on CPU).
- ``process_group``: the broadcast group of the NCCL transport (gloo on CPU), with bounded waits.
"""
