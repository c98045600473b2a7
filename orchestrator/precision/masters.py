"""fp32 master weights for half-precision parameters.

The model keeps its half parameters for forward/backward (and DDP's all-reduce);
the optimizer steps on fp32 copies, so small updates and Adam's eps do not vanish
in fp16. Capture the masters *before* the policy casts the model, so they start
from the exact fp32 values.
"""

from typing import Iterator

import torch
from torch import nn

from orchestrator.precision.policy import LayerPlan


def fp32_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state on the CPU with every floating tensor in fp32 (what checkpoints and logged models hold)."""
    return {
        key: (value.detach().float() if value.is_floating_point() else value.detach()).cpu()
        for key, value in model.state_dict().items()
    }


class MasterWeights:
    def __init__(self, model: nn.Module, plans: dict[str, LayerPlan]):
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        for name, module in model.named_modules():
            if plans[name].param_dtype == torch.float32:
                continue
            for param in module.parameters(recurse=False):
                master = param.detach().clone().float().requires_grad_(param.requires_grad)
                self.pairs.append((param, master))
        self._by_param = {id(param): master for param, master in self.pairs}

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def optimizer_params(self, model: nn.Module) -> Iterator[torch.Tensor]:
        """The tensors the optimizer steps: the fp32 master where there is one, else the parameter."""
        for param in model.parameters():
            yield self._by_param.get(id(param), param)

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """After backward: move the (all-reduced, still scaled) half gradients to the masters in fp32, adding to
        what earlier micro-batches of the same step left there (gradient accumulation)."""
        for param, master in self.pairs:
            if param.grad is not None:
                master.grad = param.grad.float() if master.grad is None else master.grad.add_(param.grad)
            param.grad = None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """After the optimizer step: round the masters back into the half parameters."""
        for param, master in self.pairs:
            param.copy_(master)

    def fp32_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict in fp32, taking half parameters' values from their masters."""
        state = {k: (v.float() if v.is_floating_point() else v).detach().cpu().clone()
                 for k, v in model.state_dict().items()}
        for name, param in model.named_parameters():
            if id(param) in self._by_param:
                state[name] = self._by_param[id(param)].detach().cpu().clone()
        return state
