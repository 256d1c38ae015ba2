"""``python -m jaxtrain.sweep``: the sweep's command line (``jaxtrain.sweep.command``)."""

import sys

from jaxtrain.sweep import run_command

sys.exit(run_command(None, "python -m jaxtrain.sweep"))
