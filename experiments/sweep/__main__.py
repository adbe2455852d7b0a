"""python -m experiments.sweep: `memtrain sweep` without the console script."""

import sys

from experiments.sweep.cli import main

sys.exit(main())
