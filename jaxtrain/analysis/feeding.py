"""How many decode cores keep the devices fed: a loader's measured images per second per core against the images
per second the devices take (a GPU plan's estimate, or a measured step).

With ``cores`` decoding at ``per_core`` images/s each, the host supplies S = cores x per_core. Devices that could
take D images/s then run at min(S, D): when S < D every step waits for its batch, and the share of the time
spent waiting is 1 - S / D (the data-wait fraction a run reports).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Feeding:
    per_core: float  # images/s one decode core gives (a worker process on its own core)
    demand: float  # images/s the devices take
    cores: int  # decode cores there are

    def __post_init__(self):
        if not (self.per_core > 0 and self.demand > 0 and self.cores >= 1):
            raise ValueError(f"per_core {self.per_core}, demand {self.demand} and cores {self.cores} must be > 0")

    @property
    def needed(self) -> int:
        """Cores that keep the devices busy."""
        return math.ceil(self.demand / self.per_core)

    @property
    def wait_share(self) -> float:
        """The share of a run's time its steps would wait for data with ``cores`` decoding."""
        return max(0.0, 1 - self.cores * self.per_core / self.demand)

    def format(self, what: str) -> str:
        return (f"{what} take {self.demand:,.0f} images/s; at {self.per_core:,.0f} images/s per decode core they need "
                f"{self.needed} cores. With {self.cores}: data wait ~{100 * self.wait_share:.0f}% of the time"
                + ("" if self.wait_share else " (fed)"))
