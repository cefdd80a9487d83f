"""The clm recipe, HF-style: model, data and training arguments from flags or a YAML/JSON file.

    python recipes/clm.py                                  # its embedded default (offline)
    python recipes/clm.py recipes/clm.yaml --learning_rate 1e-3
    torchrun --nproc_per_node 2 recipes/clm.py recipes/clm.yaml

Everything it does lives in stoker.recipes, which `stoker train --recipe clm` runs too.
"""

import sys

from stoker.recipes import main as run_recipe


def main(argv=None) -> int:
    return run_recipe(argv, recipe="clm")


if __name__ == "__main__":
    sys.exit(main())
