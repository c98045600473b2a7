"""`python -m orchestrator.sweep`: the documented command; the code is in `orchestrator.cli.sweep`."""

import sys

from orchestrator.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
