"""`python -m orchestrator.predict`: the command (`orchestrator.cli.predict`); from Python, `orchestrator.predict(
run_id or model_uri, data)` (`orchestrator.runner.predict.predict`). This module is callable as that function, so
`orchestrator.predict(...)` works even where it has been imported as a module."""

import sys
import types

from orchestrator.cli.predict import main
from orchestrator.errors import command_exit
from orchestrator.runner.predict import predict


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return predict(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    command_exit(main())
