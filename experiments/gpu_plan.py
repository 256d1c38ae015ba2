"""``python -m experiments.gpu_plan``: the command ``jaxtrain gpu-plan`` (``jaxtrain/gpu/__main__.py``), under the
name the docs and users' scripts know."""

import sys

from jaxtrain.gpu.__main__ import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m experiments.gpu_plan"))
