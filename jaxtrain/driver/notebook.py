"""A run in a Jupyter notebook: its progress bars shown (a kernel's stderr is no terminal, where bars are off
by default) and its curves redrawn below the cell after each epoch, as d2l's ``Animator`` does. Nothing of this
happens outside a notebook, nor without matplotlib (the run says once that its curves were left out)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from jaxtrain.errors import missing
from jaxtrain.train.loop import Hook, Loop


def active() -> bool:
    """Whether this process is a Jupyter kernel (IPython's shell behind a frontend that shows images)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def live_curves(epochs: Callable[[], list[dict]]) -> Hook | None:
    """An epoch hook that draws the run's curves (``epochs()``: the run's rows so far, a resumed run's earlier ones
    too) below the cell, then redraws them in place; None outside a notebook or without matplotlib."""
    if not active() or missing("matplotlib", "curves"):
        return None
    from IPython.display import Image, display

    from jaxtrain.driver.outputs import curves_png

    shown = {}

    def redraw(loop: Loop) -> None:
        image = Image(data=curves_png(epochs()), format="png")
        if "handle" in shown:
            shown["handle"].update(image)
        else:
            shown["handle"] = display(image, display_id=True)

    return Hook(redraw, unit="epoch")
