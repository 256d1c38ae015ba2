"""The bench's PyTorch ResNet-18 step (batch 64) under torch.profiler: 3 steps, self CPU time per op.
python tools/cpu-probes/torch_profile_resnet18.py
"""

import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from experiments.bench_torch import _make_step

step = _make_step("resnet18", 64, 0.2)
for _ in range(3):
    step()
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(3):
        step()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
