"""`python -m orchestrator.sweep`: the documented command; the code is in `orchestrator.cli.sweep`."""

from orchestrator.cli.sweep import main
from orchestrator.errors import command_exit

if __name__ == "__main__":
    command_exit(main())
