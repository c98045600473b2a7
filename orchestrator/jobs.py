"""`python -m orchestrator.jobs`: the documented command; the code is in `orchestrator.cli.jobs`."""

import sys

from orchestrator.cli.jobs import main

if __name__ == "__main__":
    sys.exit(main())
