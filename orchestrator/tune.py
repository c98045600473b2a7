"""`python -m orchestrator.tune`: the documented command; the code is in `orchestrator.cli.tune`."""

from orchestrator.cli.tune import main
from orchestrator.errors import command_exit

if __name__ == "__main__":
    command_exit(main())
