"""float8 only where it pays: a `dtype: float8` rule leaves out the Linear layers too small for float8 to gain
(`precision.float8_min_size`; the thresholds and their reasons are `orchestrator.precision.float8.too_small`)."""

import logging
from dataclasses import replace

import torch
from torch import nn

from orchestrator.precision.float8 import native, too_small
from orchestrator.precision.policy import LayerPlan, Policy, plan

logger = logging.getLogger("ampflow.precision")


def skip_small(model: nn.Module, policy: Policy, plans: dict[str, LayerPlan], device: torch.device) -> Policy:
    """`policy` without float8 on the Linear layers too small to gain (`precision.float8_min_size`): `auto` where
    float8 is native (a GPU with float8 tensor cores; the CPU's emulation converts every layer the rules name),
    `torchao` everywhere, `none` nowhere. A layer left out computes as if its float8 rule did not name it (the next
    matching rule, or its parent's dtype, or autocast's); the policy's `float8_skipped` and each layer's plan say
    why (its K x N against the threshold), and so does the console. `plans` (`policy.plan` of `model`) are replanned
    in place under the returned policy."""
    if policy.float8_min_size == "none" or (policy.float8_min_size == "auto" and not native(device)):
        return policy
    modules = dict(model.named_modules())
    skipped = []
    for name, layer in plans.items():
        key = "" if name == "(model)" else name
        if layer.float8 and isinstance(modules.get(key), nn.Linear):
            reason = too_small(modules[key], layer.float8)
            if reason is not None:
                skipped.append((key, reason))
                logger.warning("ampflow: float8 skipped for layer '%s' (rule %s): %s; it computes as if the rule "
                               "did not name it.", layer.name, layer.rule, reason)
    if not skipped:
        return policy
    policy = replace(policy, float8_skipped=policy.float8_skipped + tuple(skipped))
    plans.update(plan(model, policy))
    return policy
