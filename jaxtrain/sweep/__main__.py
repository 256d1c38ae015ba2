"""``python -m jaxtrain.sweep``: the sweep's command line (``jaxtrain.sweep.command``)."""

import sys

from jaxtrain.sweep.command import main

sys.exit(main())
