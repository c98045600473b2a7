"""A callback of your own: an exponential moving average (EMA) of the weights, scored beside the model.

After every optimizer step taken, the average moves towards the weights: average += (1 - decay) x
(weights - average), in fp32 on the device, over the model's floating-point weights and buffers. At
each evaluation at an epoch's end the average is put in the model's place, evaluated like the model
(`ema/eval/loss`, `ema/eval/<metric>` beside `eval/loss`, ...), and the weights are put back. The average
is part of every checkpoint (`state_dict`), so a resumed run continues it where it was.

It runs on every rank (no `rank_zero_only`): the evaluation is an all-reduce over all ranks' shards,
and every rank keeps the same average, as every rank holds the same weights under DDP.
"""

import torch

from orchestrator.train.evaluate import evaluate


class WeightAverage:
    def __init__(self, decay: float = 0.99):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be between 0 and 1, got {decay}")
        self.decay = decay
        self.average: dict[str, torch.Tensor] = {}

    @staticmethod
    def weights(loop) -> dict[str, torch.Tensor]:
        """The model's floating-point weights and buffers, by name (the live tensors)."""
        return {name: tensor for name, tensor in loop.training.prepared.raw.state_dict().items()
                if tensor.is_floating_point()}

    def setup(self, loop) -> None:
        if self.average:  # restored from the checkpoint a resumed run started from
            self.average = {name: tensor.to(loop.device) for name, tensor in self.average.items()}
        else:
            self.average = {name: tensor.detach().float().clone() for name, tensor in self.weights(loop).items()}

    @torch.no_grad()
    def after_step(self, loop, step) -> None:
        # A step the loss scaler skipped changed no weight: `taken` (1 or 0, decided on the device) leaves the
        # average as it is then, without the host waiting for the device to know which it was.
        weight = step.outcome.taken * (1.0 - self.decay)
        for name, tensor in self.weights(loop).items():
            self.average[name].lerp_(tensor.float(), weight.to(self.average[name].device))

    @torch.no_grad()
    def end_epoch(self, loop, report) -> None:
        if "eval/loss" not in report.metrics:  # the model was not evaluated this epoch (run.eval_every_n_epochs)
            return
        weights = self.weights(loop)
        own = {name: tensor.clone() for name, tensor in weights.items()}
        for name, tensor in weights.items():
            tensor.copy_(self.average[name])
        try:
            metrics = evaluate(loop.training, loop.eval_loader, loop.device)
        finally:
            for name, tensor in weights.items():
                tensor.copy_(own[name])
        report.metrics.update({f"ema/{name}": value for name, value in metrics.items()})

    def state_dict(self) -> dict:
        return {"average": {name: tensor.cpu() for name, tensor in self.average.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.average = dict(state["average"])
