"""``python -m jaxtrain.sweep``: the sweep's command line (``jaxtrain.sweep.command``)."""

import sys

from jaxtrain.errors import ConfigError

try:
    from jaxtrain.sweep.command import main
except ConfigError as e:  # its extra is not installed
    print(f"python -m jaxtrain.sweep: error: {e}", file=sys.stderr)
    sys.exit(e.EXIT_CODE)
sys.exit(main())
