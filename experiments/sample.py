"""Text from a finished language-model run: ``jaxtrain sample`` (jaxtrain.cli.sample) in the checkout.

    python -m experiments.sample RUN_DIR --prompt "And God said" --tokens 100
    python -m experiments.sample RUN_DIR --prompt "In the beginning" --temperature 0 --tokens 40   # greedy
"""

import sys

from jaxtrain.cli import sample  # light: JAX is imported after the flags are read


def main(argv=None) -> int:
    return sample(argv, prog="python -m experiments.sample")


if __name__ == "__main__":
    sys.exit(main())
