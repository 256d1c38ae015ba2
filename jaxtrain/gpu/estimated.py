"""What ``jaxtrain.gpu.estimate`` returns: a step's estimated time, its parts and its costliest ops (ESTIMATES)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class OpTime:
    """One instruction's share of a step (``count``: executions per step, loops included)."""

    name: str
    kind: str  # "matmul", "conv", "memory" (a kernel without matmuls) or a collective's kind
    label: str  # what the program says it computes (its op_name metadata)
    count: int
    flops: float
    bytes: float
    seconds: float  # all its executions, launch included
    bound: str  # "compute", "memory", "launch", "communication" or "host link"


@dataclasses.dataclass
class Estimate:
    """Per GPU, one step (one compiled call). Seconds are estimates from the target's published figures."""

    gpu: str
    gpus: int
    hosts: int
    examples: int  # examples of one step (the global call batch)
    seconds: float  # expected: launch costs, and the communication the schedule cannot hide
    lower_bound: float  # rooflines only, no launch cost, communication and host transfers fully hidden
    roofline: float  # the kernels' rooflines at the peaks (no efficiency, no launch)
    compute: float  # kernel time bound by FLOPs
    memory: float  # kernel time bound by bytes
    launch: float
    communication: float  # all collectives' time
    exposed: float  # communication the compute stream waited for
    flops: float  # matmul + convolution FLOPs (per GPU)
    peak_flops: float  # the dense peak of the step's main matmul dtype
    ops: list[OpTime]
    to_host: float = 0.0  # bytes the step writes to the host's memory (remat's offloaded values)
    from_host: float = 0.0  # bytes it reads back from there
    host_seconds: float = 0.0  # the transfers' time on the host link (beside the kernels: asynchronous)
    host_wait: float = 0.0  # of it, what the kernels waited for
    model_flops: float | None = None  # per GPU per step: 3 x the model's forward FLOPs (jaxtrain.models.flops)

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: the program's matmul and convolution FLOPs (remat's recomputation included)
        per second over the dense peak."""
        return self.flops / self.seconds / self.peak_flops

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: the model's training FLOPs (3 x forward, counted once) per second over the
        dense peak; None where the model's FLOPs were not given."""
        return self.model_flops / self.seconds / self.peak_flops if self.model_flops else None

    @property
    def overlapped_share(self) -> float:
        """The share of the communication assumed hidden behind kernels."""
        return min(1.0, max(0.0, 1 - self.exposed / self.communication)) if self.communication else 1.0

    @property
    def bottleneck(self) -> str:
        parts = {"compute": self.compute, "memory": self.memory, "launch": self.launch,
                 "communication": self.exposed, "host link": self.host_wait}
        return max(parts, key=parts.get)

    def costliest(self, n: int = 5) -> list[OpTime]:
        return sorted(self.ops, key=lambda o: -o.seconds)[:n]

    def summary(self, n: int = 5) -> dict:
        """The figures a report and its JSON show, the ``n`` costliest ops named."""
        return {"seconds": self.seconds, "lower_bound": self.lower_bound, "roofline": self.roofline,
                "examples": self.examples, "examples_per_second": self.examples_per_second,
                "mfu": self.mfu, "hfu": self.hfu,
                "bottleneck": self.bottleneck, "compute": self.compute, "memory": self.memory, "launch": self.launch,
                "communication": self.communication, "exposed": self.exposed,
                "overlapped_share": self.overlapped_share, "flops": self.flops, "peak_flops": self.peak_flops,
                "to_host": self.to_host, "from_host": self.from_host, "host_seconds": self.host_seconds,
                "host_wait": self.host_wait,
                "costliest": [dataclasses.asdict(o) for o in self.costliest(n)]}
