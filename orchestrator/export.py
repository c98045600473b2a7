"""`python -m orchestrator.export`: the documented command; the code is in `orchestrator.cli.export`."""

from orchestrator.cli.export import main
from orchestrator.errors import command_exit

if __name__ == "__main__":
    command_exit(main())
