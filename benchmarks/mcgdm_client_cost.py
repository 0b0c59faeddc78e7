"""MCGDM's local training time per image divided by FedAvg's on the same RandAugment batches
(the double backward of the gradient matching; MCGDM's aim is a ratio of at most 3): this is
``benchmarks/client_cost.py --method mcgdm``, whose docstring says what is timed and how.

    python benchmarks/mcgdm_client_cost.py [--data-root DATA] [--steps 5] [--repeats 3] [--smoke]
"""

from __future__ import annotations

import sys

from client_cost import main

if __name__ == "__main__":
    main(["--method", "mcgdm", *sys.argv[1:]])
