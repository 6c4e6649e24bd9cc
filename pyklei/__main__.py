"""`python -m pyklei ...`: the same as the `pyklei` command (pyklei/cli.py)."""
import sys

from .cli import main

sys.exit(main())
