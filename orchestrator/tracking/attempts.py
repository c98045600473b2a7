"""Why and when the Ray Train controller ended an attempt, for the run's goodput (`orchestrator.tracking.goodput`).

`AttemptWatch` runs on the controller, beside the report relay's callback: when the controller restarts the worker
group after a failure (RESTARTING) or to resize an elastic run (RESIZING), it sends one `AttemptEnded` through the
relay, with its cause: `preemption` when a rank ended its attempt on a preemption notice (`Preempted`) or Ray
drained a node (PREEMPTING before the restart), `elastic resize`, else `failure`. A node loss is a failure here;
the driver tells it apart once `NodeLossWatch` relays the lost node.
"""

import time

from ray.train.v2._internal.execution.callback import ControllerCallback  # DeveloperAPI (Ray 2.60)
from ray.train.v2._internal.execution.controller.state import (  # DeveloperAPI (Ray 2.60)
    PreemptingState, ResizingState, RestartingState,
)

from orchestrator.tracking.goodput import AttemptEnded


def failure_cause(error) -> str:
    """`preemption` when a rank's exception is a preemption notice's (`Preempted`), else `failure`."""
    failures = (getattr(error, "worker_failures", None) or {}).values()
    return "preemption" if any(type(cause).__name__ == "Preempted" for cause in failures) else "failure"


class AttemptWatch(ControllerCallback):
    """On the controller: each end of an attempt that Ray Train restarts from, once, to the relay."""

    def __init__(self, relay):
        self.relay = relay
        self.draining = False
        """Ray Train saw a node being drained (PREEMPTING): the restart that follows is a preemption."""

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if isinstance(current_state, PreemptingState):
            self.draining = True
        elif isinstance(current_state, RestartingState):
            cause = "preemption" if self.draining else failure_cause(current_state.training_failed_error)
            self.draining = False
            self.relay.push.remote(AttemptEnded(time.time(), cause))
        elif isinstance(current_state, ResizingState):
            self.relay.push.remote(AttemptEnded(time.time(), "elastic resize"))
