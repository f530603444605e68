"""`python -m moeviz.cli ...`: the `moeviz` command without its console script."""

import sys

from moeviz.cli import main

sys.exit(main())
