"""Knowledge distillation: train a student on a finished run's softened outputs mixed with the labels.

    python -m experiments.distill --teacher RUN_DIR --student lenet [--temperature 2] [--alpha 0.5] [run flags]

RUN_DIR is the teacher run's --out directory (model/ and model.json). The
loss is (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(softmax(teacher / T) ||
softmax(student / T)); the teacher's forward pass runs inside the student's
compiled train step, its weights constant step inputs. Every flag of the
student's experiment applies (--student NAME names its model); the student's
recipe gives the defaults.
"""

import sys

from jaxtrain.cli import main

PROG = "python -m experiments.distill"


def run(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a in ("-h", "--help") for a in argv):
        if not any(a == "--teacher" or a.startswith("--teacher=") for a in argv):
            print(f"{PROG}: error: --teacher RUN_DIR is required (a finished run's --out directory)", file=sys.stderr)
            return 2
        if not any(a == "--student" or a.startswith("--student=") for a in argv):
            print(f"{PROG}: error: --student NAME is required (e.g. lenet)", file=sys.stderr)
            return 2
    return main(None, argv, description=__doc__.split("\n")[0], prog=PROG, renamed={"model": "--student"})


if __name__ == "__main__":
    sys.exit(run())
