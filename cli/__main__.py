"""`python -m adaflash.cli`: the same as the `adaflash` command."""

import sys

from adaflash.cli import main

sys.exit(main())
