"""`python -m orchestrator.summary`: the documented command; the code is in `orchestrator.cli.summary`."""

from orchestrator.cli.summary import main
from orchestrator.errors import command_exit

if __name__ == "__main__":
    command_exit(main())
