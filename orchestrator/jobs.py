"""`python -m orchestrator.jobs`: the documented command; the code is in `orchestrator.cli.jobs`."""

from orchestrator.cli.jobs import main
from orchestrator.errors import command_exit

if __name__ == "__main__":
    command_exit(main())
