"""Training with a step: the trainer (compile, place, cache), the fit / evaluate loop, pipeline schedules,
checkpoints and their integrity, step timing.

Nothing here imports ``driver/``: a loop and its checkpoints are usable without the run.
"""
