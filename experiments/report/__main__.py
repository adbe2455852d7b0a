"""python -m experiments.report: `memtrain plot` without the console script."""

import sys

from experiments.report import main

sys.exit(main())
