"""`python -m orchestrator.submit`: the documented command; the code is in `orchestrator.cli.submit`."""

import sys

from orchestrator.cli.submit import main

if __name__ == "__main__":
    sys.exit(main())
