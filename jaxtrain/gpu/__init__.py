"""Compile jaxtrain's steps for GPUs on a host without one: targets, meshes of compile-only GPUs, plans.

    pip install -e '.[gpu-compile]'           # JAX's CUDA plugin (Python >= 3.12; no GPU or driver needed)
    python -m experiments.gpu_plan --model resnet18 --precision bf16 --gpu h100 --gpus 8

In Python, in a fresh process (the plugin registers before JAX's backend starts)::

    import jaxtrain as jt, jaxtrain.gpu as gpu
    mesh = gpu.mesh_for("h100", gpus=8)                   # compile-only devices
    trainer = jt.make_train_step(loss_fn, tx, mesh=mesh, precision="bf16")
    state = trainer.abstract_state(init_fn=init)          # shapes with their shardings
    compiled = trainer.lower(state, batch_shapes).compile()
    compiled.memory_analysis(), compiled.as_text()        # what each GPU holds and runs

``gpu.plan(model=..., ...)`` does all of it for a run's settings and reads the result (``GpuPlan``), with the
step time ESTIMATED from the program (``gpu.estimate``); ``gpu.scaling`` does it for a range of GPU counts.
"""

from jaxtrain.gpu.estimate import Estimate, OpTime, estimate
from jaxtrain.gpu.plan import JAX_MEMORY_FRACTION, GpuPlan, plan
from jaxtrain.gpu.scaling import format_scaling, scaling
from jaxtrain.analysis.peaks import peak_flops
from jaxtrain.gpu.targets import INSTALL, TESTED, Target, check_plugin, mesh_for, names, target

__all__ = ["Estimate", "GpuPlan", "INSTALL", "OpTime", "estimate", "format_scaling", "scaling", "JAX_MEMORY_FRACTION",
           "TESTED", "Target", "check_plugin", "mesh_for", "names", "peak_flops", "plan", "target"]
