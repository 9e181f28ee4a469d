"""Console entry points: `qarl-train` and `qarl-convert`."""
import sys


def train_main(argv=None) -> int:
    print("qarl-train: not yet available (the trainer lands with its issue)", file=sys.stderr)
    return 2


def convert_main(argv=None) -> int:
    print("qarl-convert: not yet available (the conversion CLI lands with its issue)", file=sys.stderr)
    return 2
