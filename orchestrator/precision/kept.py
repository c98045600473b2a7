"""Whether a DDP job's precision policy can be kept, checked in pre-flight: the job's model, copied, cast by the policy
and run on two samples on the CPU with the audit the workers run after their first step. A layer whose output or storage
cannot be what its rule promises is refused before Ray starts, naming the layer and the rule that would keep it,
rather than failing the run on its workers. So is a policy that would hand the layers meeting in one attention
(query, key and value) different dtypes, naming the rule that splits them."""

import copy
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from orchestrator.errors import BadInput
from orchestrator.precision import Audit, Policy, apply, autocast_context, broken_promises, plan
from orchestrator.precision.attention import MeetingGroup, deciding_rule, meeting_groups, split_groups
from orchestrator.precision.dtypes import dtype_name

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
    check_attention_blocks(cfg, trial, batch, policy, plans)
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


def check_attention_blocks(cfg: DictConfig, model: torch.nn.Module, batch: Any, policy: Policy,
                           plans: Optional[dict] = None) -> None:
    """BadInput naming the rule that would split an attention block (`check_attention_kept`), found by following
    `batch` through `model` in fp32 (`meeting_groups`); the DDP and the FSDP2 strategies' pre-flight both ask."""
    plans = plans if plans is not None else plan(model, policy)
    if not policy.autocast and len({layer.param_dtype for layer in plans.values()}) < 2:
        return  # every layer stores and computes in one dtype: no block can be split
    try:
        groups = meeting_groups(model, batch.forward)
    except Exception:  # a forward the trace cannot follow (tensor subclasses): the workers' own call still refuses
        groups = []
    check_attention_kept(cfg, policy, plans, groups)


def check_attention_kept(cfg: DictConfig, policy: Policy, plans: dict, groups: list[MeetingGroup]) -> None:
    """BadInput naming the rule when `policy` would give the layers of one attention block (those whose outputs meet
    in scaled-dot-product attention, or in a matmul of two activations) different dtypes: torch refuses the call."""
    for group, dtypes in split_groups(groups, plans, policy):
        rule = deciding_rule(group, dtypes, plans)
        index = next((i for i, r in enumerate(cfg.precision.rules)
                      if str(r.match) == rule and r.dtype is not None), None)  # the rule deciding the dtype
        named = (f"precision.rules[{index}] {{match: '{rule}', dtype: {cfg.precision.rules[index].dtype}}}"
                 if index is not None else f"the policy ({rule or cfg.precision.preset or 'its default dtype'})")
        by_dtype: dict[str, list[str]] = {}
        for layer, dtype in dtypes.items():
            by_dtype.setdefault(dtype_name(dtype), []).append(group.relative(layer))
        split = " and ".join(f"{', '.join(layers)} in {dtype}" for dtype, layers in by_dtype.items())
        wanted = cfg.precision.rules[index].dtype if index is not None else dtype_name(dtypes[group.layers[0]])
        whole = group.block if group.block != "(model)" else "*"
        raise BadInput(
            f"{named} splits an attention block: in {group.block} the attention takes {split}, and it takes its "
            f"query, key and value in one dtype (torch refuses the call). Fix: give the whole block one dtype, "
            f"e.g. {{match: '{whole}', dtype: {wanted}}}, or a rule for each of "
            f"{', '.join(group.relative(layer) for layer in group.layers)}.")
