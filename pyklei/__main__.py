"""`python -m pyklei ...`: the same as the `pyklei` command (pyklei/cli/)."""
import sys

from .cli import main

sys.exit(main())
