"""The per-layer dtype policy under FSDP2: which modules become FSDP units, and one MixedPrecisionPolicy per unit.

`fully_shard` groups parameters into units; a unit gathers all its parameters in one dtype
(`MixedPrecisionPolicy.param_dtype`), so every module whose dtype differs from its unit's must be a
unit of its own. The units (`plan_units`), in the order they are chosen:

1. the modules `scaling.fsdp.wrap` names (globs on the class or qualified name, as rules are; each glob
   the outermost modules it matches), else the model's own `fsdp_units` (an attribute or method giving
   qualified names), else each direct child holding parameters (a child sharing a parameter with the
   rest of the model is left to the root);
2. every module a rule (or `keep_norm_fp32`) gives another dtype than the unit around it, when it
   holds parameters;
3. the root.

Each unit's policy, from the same plan the DDP path uses:

- `param_dtype`: what the unit's layers compute in (the plan's dtype). The shards are stored in fp32
  when the policy keeps master weights (the shards are the masters: no copy of them is kept), else in
  that dtype (what DDP would store);
- `reduce_dtype`: `precision.reduce_dtype` (fp32 by default);
- `output_dtype`: without autocast, a unit computing in another dtype than the unit around it hands its
  output on in that unit's dtype (a fp32 head in a bf16 model returns bf16), so neighbours get the dtype
  they compute in and no activation of the other dtype is saved around it;
- `cast_forward_inputs`: without autocast, on, except for a norm layer kept in fp32 whose kernel takes
  its neighbours' half dtype as it is (as under DDP).

Under autocast (O1, bf16-mixed) parameters stay fp32 and gather in fp32: autocast decides per op,
exactly as under DDP. `FsdpAudit` proves, per layer, the dtype its parameters were gathered in, the
dtype of its shards, the dtype it computed in and the dtype it handed on.
"""

import fnmatch
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

from orchestrator.errors import BadInput
from orchestrator.precision.dtypes import dtype_name, parse_dtype
from orchestrator.precision.float8 import convert_float8, float8_layers, is_float8
from orchestrator.precision.float8_pays import skip_small
from orchestrator.precision.policy import (Audit, LayerPlan, Policy, apply, blocks_applied, broken_promises,
                                          mixed_norm_kernel, plan)

ROOT = "(model)"
"""How the root module is named in units, messages and audit entries."""


@dataclass(frozen=True)
class FsdpSettings:
    """`scaling.fsdp` and `precision.reduce_dtype`, parsed once."""

    wrap: tuple[str, ...] = ()
    """Globs naming the modules that become units (empty: the model's hint, else each direct child)."""
    reduce_dtype: torch.dtype = torch.float32
    """The dtype gradients are reduce-scattered in."""

    @classmethod
    def from_config(cls, scaling: Any, precision: Any) -> "FsdpSettings":
        return cls(wrap=tuple(str(glob) for glob in scaling.fsdp.wrap),
                   reduce_dtype=parse_dtype(precision.reduce_dtype, "precision.reduce_dtype"))


@dataclass(frozen=True)
class Unit:
    name: str
    """Qualified name of the module `fully_shard` is applied to ("" for the root)."""
    reason: str
    """Why it is a unit: the wrap glob, the model's hint, a direct child, the rule, or the root."""
    compute_dtype: torch.dtype
    """What its parameters are gathered in for forward and backward."""
    storage_dtype: torch.dtype
    """What this rank's shards of its parameters are stored in (and the optimizer steps)."""
    mp_policy: "MixedPrecisionPolicy"
    params: tuple[str, ...]
    """The parameters it manages (qualified names; those of units inside it are theirs)."""

    @property
    def label(self) -> str:
        return self.name or ROOT


@dataclass(frozen=True)
class FsdpPlan:
    units: tuple[Unit, ...]
    """Deepest first, the root last: the order `fully_shard` is applied in."""
    unit_of: dict[str, str]
    """Each module's qualified name -> the name of the unit whose parameters it computes with."""

    def unit(self, name: str) -> Unit:
        return next(unit for unit in self.units if unit.name == name)


def _holds_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _owners(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> the qualified names of the modules holding it as their own (several: a shared one)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    return owners


def _inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


def _matches(glob: str, name: str, module: nn.Module) -> bool:
    return fnmatch.fnmatchcase(type(module).__name__, glob) or fnmatch.fnmatchcase(name, glob)


def chosen_units(model: nn.Module, wrap: Sequence[str] = ()) -> dict[str, str]:
    """The units asked for (qualified name -> why), before the dtype splits and the root."""
    named = {name: module for name, module in model.named_modules() if name}
    if wrap:
        units: dict[str, str] = {}
        for index, glob in enumerate(wrap):
            hits = [name for name, module in named.items() if _holds_params(module) and _matches(glob, name, module)]
            # `*` crosses dots ('layers.*' matches 'layers.0.mlp' too): a glob names the outermost modules it matches.
            hits = [name for name in hits if not any(other != name and _inside(name, other) for other in hits)]
            if not hits:
                raise BadInput(f"scaling.fsdp.wrap[{index}]: '{glob}' matches no module holding parameters in "
                               f"{type(model).__name__} (globs match a class name such as 'Block' or a qualified "
                               "name such as 'layers.*'). Fix the glob or remove it.")
            for name in hits:
                units.setdefault(name, f"scaling.fsdp.wrap[{index}] '{glob}'")
        return units
    hint = getattr(model, "fsdp_units", None)
    if hint is not None:
        names = hint() if callable(hint) else hint
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in named:
                raise BadInput(f"model.name: {type(model).__name__}.fsdp_units names '{name}', which is not a "
                               f"submodule of the model (its submodules: {', '.join(list(named)[:8])}, ...). "
                               "Fix the model's fsdp_units or set scaling.fsdp.wrap.")
        return {name: f"{type(model).__name__}.fsdp_units" for name in names}
    owners = _owners(model)
    units = {}
    for name, child in model.named_children():
        shares_outside = any(not _inside(owner, name) for param in child.parameters() for owner in owners[id(param)])
        if _holds_params(child) and not shares_outside:
            units[name] = "a direct child holding parameters"
    return units


def plan_units(model: nn.Module, policy: Policy, plans: dict[str, LayerPlan], settings: FsdpSettings,
               device_type: str = "cpu") -> FsdpPlan:
    """The FSDP units of `model` under `policy` (its `plan()`), each with its MixedPrecisionPolicy.

    A rule FSDP cannot honour is a BadInput naming it: a module given its own dtype whose parameter is
    shared with a module outside it (FSDP keeps a shared parameter in one unit, in one dtype).
    """
    chosen = chosen_units(model, settings.wrap)
    reasons: dict[str, str] = {"": "the root"}
    unit_of: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name:
            unit_of[name] = ""
            continue
        around = unit_of[name.rpartition(".")[0]]
        layer = plans[name]
        if name in chosen:
            reasons[name] = chosen[name]
        elif layer.region and layer.param_dtype != plans[around].param_dtype and _holds_params(module):
            reasons[name] = f"rule '{layer.rule}' ({dtype_name(layer.param_dtype)})"
        unit_of[name] = name if name in reasons else around

    owners = _owners(model)
    managed: dict[str, list[str]] = {name: [] for name in reasons}
    for param_name, param in model.named_parameters():
        units = {unit_of[owner] for owner in owners[id(param)]}
        if len(units) > 1:
            raise BadInput(_shared_parameter_message(param_name, owners[id(param)], units, reasons, plans))
        managed[units.pop()].append(param_name)

    built = []
    for name in sorted(reasons, key=lambda n: (-n.count(".") if n else 1, n)):  # deepest first, root last
        compute = plans[name].param_dtype
        built.append(Unit(name=name, reason=reasons[name], compute_dtype=compute,
                          storage_dtype=torch.float32 if policy.master_weights else compute,
                          mp_policy=_mp_policy(model, name, policy, plans, settings, unit_of, device_type),
                          params=tuple(managed[name])))
    return FsdpPlan(units=tuple(built), unit_of=unit_of)


def _mp_policy(model: nn.Module, name: str, policy: Policy, plans: dict[str, LayerPlan], settings: FsdpSettings,
               unit_of: dict[str, str], device_type: str) -> "MixedPrecisionPolicy":
    """Under autocast FSDP casts nothing (autocast decides per op, and a rule's region casts its own inputs, as under
    DDP); without it, the unit's inputs go to its dtype and its output back to the dtype of the unit around it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # seconds to import: only runs under FSDP need it

    compute = plans[name].param_dtype
    if not name:
        return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=settings.reduce_dtype,
                                    cast_forward_inputs=not policy.autocast)
    neighbours = plans[unit_of[name.rpartition(".")[0]]].param_dtype
    # The dtype apply() probes a kept-fp32 norm kernel with: the two must agree on whether it mixes dtypes.
    probed = policy.compute_dtype if policy.autocast else policy.param_dtype
    keeps_neighbours = plans[name].keeps_neighbour_dtype and mixed_norm_kernel(
        model.get_submodule(name), probed, device_type)
    hands_on = not policy.autocast and not keeps_neighbours and compute != neighbours
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=settings.reduce_dtype,
                                output_dtype=neighbours if hands_on else None,
                                cast_forward_inputs=not policy.autocast and not keeps_neighbours)


def _shared_parameter_message(param: str, owners: list[str], units: set[str], reasons: dict[str, str],
                              plans: dict[str, LayerPlan]) -> str:
    described = ", ".join(f"'{unit or ROOT}' ({dtype_name(plans[unit].param_dtype)}, {reasons[unit]})"
                          for unit in sorted(units))
    return (f"precision: parameter '{param}' is shared by {', '.join(repr(o or ROOT) for o in owners)}, which fall in "
            f"different FSDP units: {described}. FSDP keeps a shared parameter in one unit, gathered in one dtype: "
            "give the modules sharing it one dtype (drop or widen the rule), or make their common parent the unit "
            "(scaling.fsdp.wrap).")


def prepare(model: nn.Module, policy: Policy, settings: FsdpSettings, device_type: str
            ) -> tuple[dict[str, LayerPlan], FsdpPlan]:
    """Plan `model` (fp32, every rank's weights equal) for FSDP: its units, the compute hooks of the policy, the
    buffers in their layers' dtype and each unit's parameters in its storage dtype. Shard it afterwards
    (`orchestrator.train.fsdp.shard`), then start the audit (`FsdpAudit`)."""
    plans = plan(model, policy)
    policy = skip_small(model, policy, plans, torch.device(device_type))  # float8 only where it pays
    fsdp_plan = plan_units(model, policy, plans, settings, device_type)
    convert_float8(model, float8_layers(plans), torch.device(device_type), fsdp=True)  # before hooks and shards
    apply(model, policy, plans, device_type, cast_params=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for unit in fsdp_plan.units:
            for name in unit.params:
                params[name].data = params[name].data.to(unit.storage_dtype)
    return plans, fsdp_plan


def _first_dtype(value: Any) -> Optional[torch.dtype]:
    while isinstance(value, (tuple, list)) and value:
        value = value[0]
    return value.dtype if isinstance(value, torch.Tensor) else None


class FsdpAudit(Audit):
    """The audit of one forward pass under FSDP. Start it after `fully_shard`: its hooks must run after FSDP's
    pre-forward (the parameters are gathered then) and around FSDP's post-forward (before and after the output
    cast).

    Each entry adds to the DDP audit's: `unit`, `storage_dtype` (this rank's shards), `compute_dtype` (the
    layer's output before its unit's output cast) and their promises; `param_dtype` is the dtype the
    parameters were gathered in (what the layer computed with), `output_dtype` what its neighbours got.
    """

    def __init__(self, model: nn.Module, policy: Policy, plans: dict[str, LayerPlan], fsdp_plan: FsdpPlan):
        super().__init__(model, policy, plans)
        self.fsdp_plan = fsdp_plan
        # Read now, while every unit's parameters are its shards (between forward and backward the root's are not).
        self.stored = {name: own.dtype for name, module in self.modules.items()
                       if (own := next(module.parameters(recurse=False), None)) is not None}
        self.gathered: dict[str, torch.dtype] = {}
        self.computed: dict[str, torch.dtype] = {}
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(partial(self._record_gathered, name=name)))
            self.handles.append(module.register_forward_hook(partial(self._record_computed, name=name), prepend=True))

    def _record_gathered(self, module: nn.Module, args: tuple, *, name: str) -> None:
        own = next(module.parameters(recurse=False), None)
        if own is not None and name not in self.gathered:
            self.gathered[name] = own.dtype

    def _record_computed(self, module: nn.Module, args: tuple, output: Any, *, name: str) -> None:
        dtype = _first_dtype(output)
        if dtype is not None and name not in self.computed:
            self.computed[name] = dtype

    def close(self) -> list[dict[str, Any]]:
        """Remove the hooks and return one entry per layer that has parameters or a rule."""
        for handle in self.handles:
            handle.remove()
        entries = []
        for name in self.modules:
            layer = self.plans[name]
            if not (layer.has_params or layer.region or layer.checkpoint or layer.compile):
                continue
            unit = self.fsdp_plan.unit(self.fsdp_plan.unit_of[name])
            stored = self.stored.get(name)
            promised_compute = layer.promised_output_dtype(self.policy, self.inputs.get(name))
            own_unit = unit.name == name
            output_cast = unit.mp_policy.output_dtype if own_unit and name else None
            promised_out = output_cast if output_cast is not None else promised_compute
            entries.append({
                "name": layer.name, "type": layer.type, "unit": unit.label,
                "param_dtype": _name(self.gathered.get(name)),
                "storage_dtype": _name(stored),
                "compute_dtype": _name(self.computed.get(name)),
                "output_dtype": _name(self.outputs.get(name)),
                "promised_param_dtype": dtype_name(layer.param_dtype),
                "promised_storage_dtype": dtype_name(unit.storage_dtype) if stored is not None else None,
                "promised_compute_dtype": _name(promised_compute),
                "promised_output_dtype": _name(promised_out),
                "rule": layer.rule, "autocast": self.policy.autocast,
                "float8": is_float8(self.modules[name]), "promised_float8": layer.float8 is not None,
                "float8_skipped": layer.float8_skipped, **blocks_applied(self.modules[name], layer),
            })
        return entries

    def broken(self, entries: list[dict[str, Any]]) -> list[str]:
        """The promises the closed audit's `entries` broke: the DDP audit's and the shards' (`broken_fsdp_promises`)."""
        return broken_fsdp_promises(entries)


def _name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return dtype_name(dtype) if dtype is not None else None


def broken_fsdp_promises(entries: list[dict[str, Any]]) -> list[str]:
    """One message per layer whose gathered parameters, shards, computation or output broke the plan."""
    problems = broken_promises(entries)
    for e in entries:
        for what, verb in (("storage", "stores its shards in"), ("compute", "computed in")):
            promised, actual = e[f"promised_{what}_dtype"], e[f"{what}_dtype"]
            if promised is not None and actual not in (None, promised):
                problems.append(f"layer '{e['name']}' ({e['type']}, FSDP unit '{e['unit']}') {verb} {actual}, "
                                f"policy promised {promised}" + (f" (rule {e['rule']})" if e["rule"] else ""))
    return problems
