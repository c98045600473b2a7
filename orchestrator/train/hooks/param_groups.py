"""`optim/param_groups`: which optimizer group each parameter landed in, with the group's settings."""

from orchestrator.train.hooks import Hook
from orchestrator.train.optim import param_group_table


class ParamGroupTable(Hook):
    """The table goes out once, with a fresh run's first report, from rank 0 (every rank's groups are alike)."""

    name = "param_groups"
    rank_zero_only = True

    def __init__(self, fresh: bool) -> None:
        self.due = fresh

    def collect(self, loop, report) -> None:
        if self.due:
            training = loop.training
            report.tables["optim/param_groups"] = param_group_table(loop.cfg.optim, training.optimizer,
                                                                    training.strategy.named_optimizer_params())
            self.due = False
