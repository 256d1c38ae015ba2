"""Where things live and how shards meet: meshes and devices, the sharding rules of a state, the ``Plan``
(every placement decided once), the strategies that wrap the step and reduce it (jit, explicit, shard_map,
pmap, ring), our collectives, the compiled step, host memory.

Imports ``core/`` and the ground; nothing of ``nn/``, ``kernels/``, ``models/``, ``train/``, ``driver/``.
"""
