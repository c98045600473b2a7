"""`python -m orchestrator.export`: the documented command; the code is in `orchestrator.cli.export`."""

import sys

from orchestrator.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
