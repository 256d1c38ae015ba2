"""The library's named choices, in one JAX-free place (the command line reads them before JAX is imported)."""

STRATEGIES = ("jit", "shard_map", "pmap", "ring")  # jaxtrain.parallel
PRECISIONS = ("fp32", "bf16", "fp16")  # jaxtrain.precision.POLICIES
ACCUM_MODES = ("scan", "multisteps")  # jaxtrain.accumulate
PARAM_SHARDINGS = ("replicated", "fsdp", "tp", "fsdp+tp")  # jaxtrain.sharding.preset
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")  # jaxtrain.optim
LR_SCHEDULES = ("constant", "cosine", "warmup_cosine", "onecycle")  # jaxtrain.optim.make_schedule
PIPELINE_SCHEDULES = ("gpipe", "circular")  # pipeline schedules (jaxtrain.pipeline)
AUGMENTATIONS = ("none", "crop+flip")  # jaxtrain.data.augment
