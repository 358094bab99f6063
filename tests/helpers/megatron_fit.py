"""``lightning-fasync fit`` with megatron-core on CPU, for tests: the CLI under
``tests/helpers/megatron_cpu.py``'s ``cpu_training_shim`` (Lightning's launcher re-runs this script in every
rank's process, so each rank gets the shim). The rollout engines are processes of their own and
run without it."""

import sys
import warnings

from megatron_cpu import cpu_training_shim

from lightning_fasync.lightning.cli import main

if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    with cpu_training_shim():
        sys.exit(main())
