"""`python -m orchestrator.summary`: the documented command; the code is in `orchestrator.cli.summary`."""

import sys

from orchestrator.cli.summary import main

if __name__ == "__main__":
    sys.exit(main())
