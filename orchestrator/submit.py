"""`python -m orchestrator.submit`: the documented command; the code is in `orchestrator.cli.submit`."""

from orchestrator.cli.submit import main
from orchestrator.errors import command_exit

if __name__ == "__main__":
    command_exit(main())
