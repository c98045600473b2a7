"""Whether a DDP job's precision policy can be kept, checked in pre-flight: the job's model, copied, cast by the policy
and run on two samples on the CPU with the audit the workers run after their first step. A layer whose output or storage
cannot be what its rule promises is refused before Ray starts, naming the layer and the rule that would keep it,
rather than failing the run on its workers."""

import copy
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from orchestrator.errors import BadInput
from orchestrator.precision import Audit, Policy, apply, autocast_context, broken_promises, plan

CPU = "cpu"


def check_policy_kept(cfg: DictConfig, model: torch.nn.Module, batch: Any, policy: Optional[Policy] = None) -> None:
    """`batch`: the first training `Batch` pre-flight collated. DDP's check (`DdpStrategy.check_plan`): FSDP's
    units and their policies are planned and checked by its own. Nothing to check where every layer is fp32 without
    autocast (O0)."""
    policy = policy or Policy.from_config(cfg.precision)
    plans = plan(model, policy)
    if not policy.autocast and all(layer.param_dtype == torch.float32 for layer in plans.values()):
        return
    trial = copy.deepcopy(model).cpu()
    plans = plan(trial, policy)
    apply(trial, policy, plans, CPU)
    audit = Audit(trial, policy, plans)
    try:
        with torch.no_grad(), autocast_context(policy.amp, CPU):
            batch.forward(trial)
    except Exception:  # a model that runs on the GPU only in half precision: the workers' audit still holds
        audit.close()
        return
    entries = audit.close()
    problems = broken_promises(entries)
    if not problems:
        return
    modules = dict(trial.named_modules())
    broken = next(e for e in entries if e["promised_output_dtype"] is not None
                  and e["output_dtype"] not in (None, e["promised_output_dtype"])) if any(
        "computed in" in p for p in problems) else None
    hint = ""
    if broken is not None and broken["output_dtype"] in ("float32", "float16", "bfloat16"):
        name = broken["name"] if broken["name"] != "(model)" else type(modules[""]).__name__
        hint = (f" Keep that layer in the dtype it computes in with a rule first in precision.rules: "
                f"{{match: '{name}', dtype: {broken['output_dtype']}}}.")
    preset = cfg.precision.preset or "the precision section"
    raise BadInput(f"precision: {preset} cannot be kept on model.name {cfg.model.name}: "
                   f"{'; '.join(problems)}.{hint}")
