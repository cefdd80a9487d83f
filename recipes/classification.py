"""The classification recipe, HF-style: model, data and training arguments from flags or a YAML/JSON file.

    python recipes/classification.py                                  # its embedded default (offline)
    python recipes/classification.py recipes/classification.yaml --learning_rate 1e-3
    torchrun --nproc_per_node 2 recipes/classification.py recipes/classification.yaml

Everything it does lives in stoker.recipes, which `stoker train --recipe classification` runs too.
"""

import sys

from stoker.recipes import main as run_recipe


def main(argv=None) -> int:
    return run_recipe(argv, recipe="classification")


if __name__ == "__main__":
    sys.exit(main())
