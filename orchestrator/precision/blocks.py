"""What a rule does to a block besides its dtype: activation checkpointing (`checkpoint: full | selective`) and
regional compilation (`compile: true`).

`apply_blocks` runs after the dtype policy is in place (`policy.apply`, float8) and before the model is wrapped
for data parallelism: checkpointing, then compilation, then `fully_shard` or DDP, as torchtitan orders them.

Checkpointing runs the block's forward through `torch.utils.checkpoint.checkpoint` (non-reentrant), the call
torch's `checkpoint_wrapper` makes, but on the block itself rather than in a wrapper module around it: every
qualified name (parameters, the audit, optimizer groups, checkpoints, FSDP units) stays what the model calls it.
`selective` saves the outputs of the block's matmuls and attention and recomputes the cheap ops between them
(torchtitan's op-level selective AC, `create_selective_checkpoint_contexts`). Compilation is `module.compile()`,
which also keeps the names (no `_orig_mod`).
"""

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from orchestrator.errors import BadInput
from orchestrator.precision.policy import CHECKPOINTED, LayerPlan, Policy

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.linear.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_mm.default,
}
"""What `checkpoint: selective` saves: the outputs of matmuls and attention (expensive to recompute)."""


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpointed_forward(forward: Callable, context_fn: Optional[Callable], *args: Any, **kwargs: Any) -> Any:
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    # What selective checkpointing saves goes through the saved-tensor hooks around it, as any saved tensor: the
    # memory ledger counts it.
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, respect_saved_tensors_hooks=True,
                      **kwargs)


def checkpoint_block(module: nn.Module, mode: str) -> None:
    """Checkpoint `module`'s activations (`full` or `selective`), in place."""
    context_fn = _selective_contexts if mode == "selective" else None
    module.forward = partial(_checkpointed_forward, module.forward, context_fn)
    setattr(module, CHECKPOINTED, mode)


def checkpointed(module: nn.Module) -> Optional[str]:
    """The mode `module` is checkpointed in (`checkpoint_block`), or None."""
    return getattr(module, CHECKPOINTED, None)


def compiled(module: nn.Module) -> bool:
    """Whether `module` was compiled on its own (`module.compile()`)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def apply_blocks(model: nn.Module, plans: dict[str, LayerPlan], compile_options: Optional[dict[str, Any]] = None
                 ) -> None:
    """Checkpoint, then compile, each block the plans say (`compile_options`: torch.compile's arguments, from
    `perf.compile_backend` and `perf.compile_mode`). The audit reads back what each block got."""
    for name, module in model.named_modules():
        layer = plans.get(name)
        if layer is not None and layer.checkpoint:
            checkpoint_block(module, layer.checkpoint)
        if layer is not None and layer.compile:
            module.compile(**(compile_options or {}))


def compile_options(perf: Any) -> dict[str, Any]:
    """torch.compile's arguments for a block (`perf.compile_backend`, `perf.compile_mode`)."""
    return {"backend": perf.compile_backend, "mode": perf.compile_mode}


def check_block_rules(model: nn.Module, policy: Policy) -> None:
    """Pre-flight: a rule that checkpoints or compiles must match some module of `model` (BadInput naming it)."""
    named = list(model.named_modules())
    for index, rule in enumerate(policy.rules):
        if not (rule.checkpoint or rule.compile) or rule.label is not None:
            continue
        if not any(rule.matches(name, module) for name, module in named):
            what = " and ".join(w for w in (f"checkpoint: {rule.checkpoint}" if rule.checkpoint else "",
                                            "compile: true" if rule.compile else "") if w)
            raise BadInput(f"precision.rules[{index}].match: '{rule.match}' ({what}) matches no module of "
                           f"{type(model).__name__} (globs match a class name such as 'Block' or a qualified name "
                           f"such as 'layers.*'; its modules: {', '.join(n for n, _ in named[1:9])}, ...). Fix the "
                           "glob or remove the rule.")
