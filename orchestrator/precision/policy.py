"""Per-layer dtype policy: which dtype each layer stores its parameters in and computes in.

A policy is the `precision` section: a default parameter dtype, an autocast dtype,
rules `{match, dtype, checkpoint, compile}` (glob on the class name or the qualified name; each of the three is
decided by the first rule matching the module that sets it: a rule without a dtype decides no dtype), and
`keep_norm_fp32`. `plan()` resolves it to one `LayerPlan` per module;
`apply()` casts parameters and installs the hooks that make each layer compute in
its dtype and hand its neighbours what they expect. Apply before DDP wrapping.
"""

import copy
import fnmatch
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Optional, Sequence

import torch
from torch import nn

from orchestrator.errors import BadInput
from orchestrator.precision.amp import AmpSettings
from orchestrator.precision.dtypes import dtype_name, parse_dtype
from orchestrator.precision.float8 import FLOAT8, MIN_SIZES, is_float8

NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
# Layers whose output autocast puts in the compute dtype (what the audit holds O1 to).
AUTOCAST_TYPES = (nn.modules.conv._ConvNd, nn.Linear)


PROMOTED = "promoted"
"""The `rule` the audit shows for a layer moved to fp32 at run time (`on_collapse: promote`)."""


CHECKPOINTED = "_ampflow_checkpoint"
"""The attribute a checkpointed block carries: its mode (`orchestrator.precision.blocks`; what the audit reads)."""

CHECKPOINT_MODES = ("full", "selective")
"""`precision.rules[i].checkpoint`: activation checkpointing of a whole block, or of its cheap ops only."""


@dataclass(frozen=True)
class Rule:
    match: str
    dtype: Optional[torch.dtype]
    """None: the rule decides no dtype (it checkpoints or compiles only)."""
    label: Optional[str] = None
    """What the audit names as the deciding rule; the glob itself when None."""
    float8: Optional[str] = None
    """`dtype: float8`: the scaling of the Linear layers' float8 matmuls (`tensorwise`, `rowwise`); they store
    their parameters in `dtype` (fp32)."""
    checkpoint: Optional[str] = None
    """Activation checkpointing of the matched blocks (`full`, `selective`), or None."""
    compile: bool = False
    """Regional compilation of each matched block."""

    def matches(self, qualified_name: str, module: nn.Module) -> bool:
        return fnmatch.fnmatchcase(type(module).__name__, self.match) or (
            qualified_name != "" and fnmatch.fnmatchcase(qualified_name, self.match)
        )


def _rule(rule: Any, key: str) -> Rule:
    """One `precision.rules` entry, parsed (BadInput naming the key)."""
    checkpoint = rule.get("checkpoint")
    if checkpoint is not None and str(checkpoint) not in CHECKPOINT_MODES:
        raise BadInput(f"{key}.checkpoint: unknown mode '{checkpoint}'. Use one of {', '.join(CHECKPOINT_MODES)} "
                       "(or leave it out: no activation checkpointing).")
    compile_block = bool(rule.get("compile", False))
    dtype = rule.get("dtype")
    if dtype is None and checkpoint is None and not compile_block:
        raise BadInput(f"{key}: the rule for '{rule.match}' sets none of dtype, checkpoint or compile, so it does "
                       "nothing. Give it a dtype, `checkpoint: full | selective` or `compile: true`, or remove it.")
    extras = {"checkpoint": None if checkpoint is None else str(checkpoint), "compile": compile_block}
    if dtype is None:
        return Rule(str(rule.match), None, **extras)
    if str(dtype) == FLOAT8:
        return Rule(str(rule.match), torch.float32, float8=str(rule.get("scaling", "tensorwise")), **extras)
    return Rule(str(rule.match), parse_dtype(dtype, f"{key}.dtype", also=(FLOAT8,)), **extras)


def _float8_min_size(precision: Any) -> str:
    value = str(precision.get("float8_min_size", "auto"))
    if value not in MIN_SIZES:
        raise BadInput(f"precision.float8_min_size: unknown value '{value}'. Use one of {', '.join(MIN_SIZES)}.")
    return value


@dataclass(frozen=True)
class Policy:
    amp: AmpSettings
    """The autocast dtype and the loss-scaling settings (parsed from the same section)."""
    param_dtype: torch.dtype
    master_weights: bool
    keep_norm_fp32: bool
    rules: tuple[Rule, ...]
    float8_min_size: str = "auto"
    """Which Linear layers float8 rules leave out as too small to gain
    (`orchestrator.precision.float8_pays.skip_small`)."""
    float8_skipped: tuple[tuple[str, str], ...] = ()
    """(layer, why) for the Linear layers float8 rules leave out here (`skip_small`): no float8 rule matches them, as
    if the rule did not name them."""

    @classmethod
    def from_config(cls, precision: Any) -> "Policy":
        """The whole `precision` section, each field parsed here once (BadInput naming the key)."""
        rules = tuple(_rule(rule, f"precision.rules[{i}]") for i, rule in enumerate(precision.rules))
        return cls(
            amp=AmpSettings.from_config(precision),
            param_dtype=parse_dtype(precision.param_dtype, "precision.param_dtype"),
            master_weights=bool(precision.master_weights),
            keep_norm_fp32=bool(precision.keep_norm_fp32),
            rules=rules,
            float8_min_size=_float8_min_size(precision),
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.amp.compute_dtype

    @property
    def autocast(self) -> bool:
        return self.amp.autocast_enabled

    def stores(self, dtype: torch.dtype) -> bool:
        """Whether some layer stores its parameters in `dtype` (a rule that matches nothing is a lint finding)."""
        return self.param_dtype == dtype or any(rule.dtype == dtype for rule in self.rules)

    def uses(self, dtype: torch.dtype) -> bool:
        """Whether any layer computes or stores in `dtype` under this policy."""
        return (self.autocast and self.compute_dtype == dtype) or self.stores(dtype)

    @property
    def fp16_gradients(self) -> bool:
        """Some gradient is float16: fp16 autocast, or a layer whose parameters are float16."""
        return (self.autocast and self.compute_dtype == torch.float16) or self.stores(torch.float16)

    @property
    def scaler_enabled(self) -> bool:
        """Loss scaling follows the gradients: on whenever one is float16, unless `loss_scale: none`."""
        return self.fp16_gradients and self.amp.loss_scale != "none"

    def with_promoted(self, layers: Sequence[str]) -> "Policy":
        """This policy with each named layer (qualified name) moved to fp32, ahead of every other rule."""
        promoted = tuple(Rule(name, torch.float32, label=PROMOTED) for name in layers)
        return replace(self, rules=promoted + self.rules)


@dataclass(frozen=True)
class LayerPlan:
    name: str
    type: str
    param_dtype: torch.dtype
    """What this module's own parameters are stored in."""
    region: bool
    """A rule (or keep_norm_fp32) names this module: autocast is off inside it, inputs cast to its dtype."""
    in_region: bool
    """This module is the ruled module or inside one: it computes in `param_dtype`."""
    rule: Optional[str]
    """The glob (or `keep_norm_fp32`) that decided this module's dtype, if any."""
    has_params: bool
    type_is_autocast: bool
    """Conv or Linear: autocast runs it in the compute dtype."""
    float8: Optional[str] = None
    """A float8 rule names this Linear layer: its matmuls run in float8 with this scaling (`precision.float8`)."""
    float8_skipped: Optional[str] = None
    """A float8 rule names this Linear layer, but it is too small for float8 to gain (`precision.float8_min_size`):
    why (its K x N against the threshold). It computes as it would without the float8 rule."""
    keeps_neighbour_dtype: bool = False
    """A normalisation layer kept in fp32 among half layers: its kernel computes in fp32 but takes and returns
    its neighbours' half dtype (as cuDNN's BatchNorm and Apex O2), so no fp32 activations are saved around
    it. `apply` turns it off where the device's kernel cannot mix dtypes."""
    last_child: Optional[str] = None
    """A container's last child (its qualified name): a container holding parameters of its own (a ViT's class
    token and position embeddings) outputs what its last layer computes, so its promise is that layer's."""
    checkpoint: Optional[str] = None
    """A rule checkpoints this block's activations (`full`, `selective`); None inside a checkpointed block."""
    checkpoint_rule: Optional[str] = None
    """The glob that decided `checkpoint`."""
    compile: bool = False
    """A rule compiles this block on its own; False inside a compiled block."""
    compile_rule: Optional[str] = None
    """The glob that decided `compile`."""

    def promised_output_dtype(self, policy: Policy, input_dtype: Optional[torch.dtype] = None,
                              plans: Optional[dict[str, "LayerPlan"]] = None) -> Optional[torch.dtype]:
        """The output dtype this layer is held to after a step; None where nothing is promised.
        `input_dtype`: what the layer was given (a layer that keeps its neighbours' dtype returns it). `plans`:
        every layer's, for a container's promise (its last layer's); without them a container promises nothing."""
        if self.keeps_neighbour_dtype:
            return input_dtype
        if self.last_child is not None and not self.region:
            last = (plans or {}).get(self.last_child)
            return last.promised_output_dtype(policy, None, plans) if last is not None else None
        if self.in_region and self.has_params:
            return self.param_dtype
        if not self.has_params:
            return None
        if policy.autocast:
            return policy.compute_dtype if self.type_is_autocast else None
        return self.param_dtype


def plan(model: nn.Module, policy: Policy) -> dict[str, LayerPlan]:
    """One LayerPlan per module (qualified name -> plan), parents before children."""
    plans: dict[str, LayerPlan] = {}
    for name, module in model.named_modules():
        parent = plans.get(name.rpartition(".")[0]) if name else None
        skipped = dict(policy.float8_skipped).get(name)
        matching = [r for r in policy.rules if r.matches(name, module) and not (r.float8 and skipped)]
        rule = next((r for r in matching if r.dtype is not None), None)
        checkpointing = next((r for r in matching if r.checkpoint is not None), None)
        compiling = next((r for r in matching if r.compile), None)
        if name and any(plans[a].checkpoint for a in _ancestors(name) if a in plans):
            checkpointing = None
        if name and any(plans[a].compile for a in _ancestors(name) if a in plans):
            compiling = None
        decided_by = (rule.label or rule.match) if rule else None
        dtype = rule.dtype if rule else None
        if rule is None and policy.keep_norm_fp32 and isinstance(module, NORM_TYPES):
            decided_by, dtype = "keep_norm_fp32", torch.float32
        in_region = dtype is not None or (parent is not None and parent.in_region)
        inherited = parent.param_dtype if parent is not None else policy.param_dtype
        neighbours = policy.compute_dtype if policy.autocast else inherited
        if dtype is None:
            dtype = inherited
        plans[name] = LayerPlan(
            name=name or "(model)",
            type=type(module).__name__,
            param_dtype=dtype,
            region=decided_by is not None,
            in_region=in_region,
            rule=decided_by or (parent.rule if parent is not None and parent.in_region else None),
            has_params=any(True for _ in module.parameters(recurse=False)),
            type_is_autocast=isinstance(module, AUTOCAST_TYPES),
            keeps_neighbour_dtype=decided_by is not None and dtype == torch.float32 and isinstance(module, NORM_TYPES)
            and neighbours != torch.float32,
            float8=rule.float8 if rule is not None else None,
            float8_skipped=skipped,
            last_child=next((f"{name}.{child}" if name else child for child, _ in reversed(
                list(module.named_children()))), None),
            checkpoint=checkpointing.checkpoint if checkpointing else None,
            checkpoint_rule=checkpointing.match if checkpointing else None,
            compile=compiling is not None,
            compile_rule=compiling.match if compiling else None,
        )
    return plans


def _ancestors(name: str) -> list[str]:
    """The qualified names of the modules around `name` ("" for the model), outermost first."""
    parts = name.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]


def unmatched_rules(model: nn.Module, policy: Policy) -> list[Rule]:
    named = list(model.named_modules())
    return [rule for rule in policy.rules if not any(rule.matches(n, m) for n, m in named)]


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def _cast_inputs_hook(module: nn.Module, args: tuple, kwargs: dict, *, dtype: torch.dtype):
    return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)


def _enter_fp_region(module: nn.Module, args: tuple, *, device_type: str) -> None:
    context = torch.autocast(device_type=device_type, enabled=False)
    context.__enter__()
    module.__dict__.setdefault("_ampflow_regions", []).append(context)


def _exit_fp_region(module: nn.Module, args: tuple, output: Any) -> None:
    regions = module.__dict__.get("_ampflow_regions")
    if regions:
        regions.pop().__exit__(None, None, None)


_MIXED_NORM_KERNELS: dict[tuple[type, torch.dtype, str], bool] = {}


def mixed_norm_kernel(module: nn.Module, dtype: torch.dtype, device_type: str) -> bool:
    """Whether this norm layer's kernel takes `dtype` inputs with fp32 parameters on `device_type` and returns
    `dtype` (tried once per layer type on a tiny tensor; CPU and CUDA kernels of torch 2.x do for all four)."""
    key = (type(module), dtype, device_type)
    if key not in _MIXED_NORM_KERNELS:
        probe = copy.deepcopy(module).float().to(device_type)
        if isinstance(probe, nn.LayerNorm):
            shape = (2, *probe.normalized_shape)
        else:
            channels = probe.num_channels if isinstance(probe, nn.GroupNorm) else probe.num_features
            shape = (2, channels, 2) if isinstance(probe, nn.BatchNorm1d) else (2, channels, 2, 2)
            shape = shape + (2,) if isinstance(probe, (nn.BatchNorm3d, nn.InstanceNorm3d)) else shape
        try:
            with torch.no_grad(), torch.autocast(device_type, enabled=False):
                _MIXED_NORM_KERNELS[key] = probe(torch.ones(shape, dtype=dtype, device=device_type)).dtype == dtype
        except (RuntimeError, TypeError, ValueError):
            _MIXED_NORM_KERNELS[key] = False
    return _MIXED_NORM_KERNELS[key]


def apply(model: nn.Module, policy: Policy, plans: dict[str, LayerPlan], device_type: Optional[str], *,
          cast_params: bool = True) -> nn.Module:
    """Cast each module's own parameters and floating buffers, and install the compute hooks.

    `device_type` is the autocast device of training; None for inference without autocast
    (export, on the CPU), where only the input casts are needed. A layer planned to keep its
    neighbours' dtype whose kernel cannot mix dtypes on this device gets its inputs cast instead
    (its entry in `plans` is updated). `cast_params=False` (FSDP) leaves the parameters as they are:
    their shards keep the storage dtype and FSDP gathers them in the planned one.
    """
    autocast = policy.autocast and device_type is not None
    neighbours = policy.compute_dtype if policy.autocast else policy.param_dtype
    # Everything fp32 and no autocast (O0): every input is already what each layer computes in, and a hook per
    # layer would only cost time on every step.
    all_fp32 = not autocast and all(layer.param_dtype == torch.float32 for layer in plans.values())
    for name, module in model.named_modules():
        layer = plans[name]
        if layer.keeps_neighbour_dtype and not mixed_norm_kernel(module, neighbours, device_type or "cpu"):
            layer = plans[name] = replace(layer, keeps_neighbour_dtype=False)
        for param in module.parameters(recurse=False) if cast_params else ():
            param.data = param.data.to(layer.param_dtype)
        for key, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                module._buffers[key] = buffer.to(layer.param_dtype)
        # Cast inputs to what the layer stores, except where autocast already decides (fp32 layers under O1),
        # and where the layer's fp32 kernel takes its neighbours' dtype as it is.
        if layer.keeps_neighbour_dtype or all_fp32:
            pass
        elif layer.region or (layer.has_params and not (autocast and layer.param_dtype == torch.float32)):
            module.register_forward_pre_hook(partial(_cast_inputs_hook, dtype=layer.param_dtype), with_kwargs=True)
        if layer.region and autocast:
            module.register_forward_pre_hook(partial(_enter_fp_region, device_type=device_type), prepend=True)
            module.register_forward_hook(_exit_fp_region, always_call=True)
    return model


class Audit:
    """Records the input and output dtypes of every layer in one forward pass, then compares with the plan."""

    def __init__(self, model: nn.Module, policy: Policy, plans: dict[str, LayerPlan]):
        self.policy, self.plans, self.outputs, self.inputs = policy, plans, {}, {}
        self.modules = dict(model.named_modules())
        self.handles = [
            module.register_forward_hook(partial(self._record, name=name)) for name, module in self.modules.items()
        ]

    def _record(self, module: nn.Module, args: tuple, output: Any, *, name: str) -> None:
        if name in self.outputs:
            return
        for value, into in ((output, self.outputs), (args, self.inputs)):
            first = value
            while isinstance(first, (tuple, list)) and first:
                first = first[0]
            if isinstance(first, torch.Tensor):
                into[name] = first.dtype

    def close(self) -> list[dict[str, Any]]:
        """Remove the hooks and return one entry per layer that has parameters or a rule."""
        for handle in self.handles:
            handle.remove()
        entries = []
        for name, module in self.modules.items():
            layer = self.plans[name]
            if not (layer.has_params or layer.region or layer.checkpoint or layer.compile):
                continue
            params = list(module.parameters(recurse=False))
            promised_out = layer.promised_output_dtype(self.policy, self.inputs.get(name), self.plans)
            out = self.outputs.get(name)
            entries.append({
                "name": layer.name,
                "type": layer.type,
                "param_dtype": dtype_name(params[0].dtype) if params else None,
                "output_dtype": dtype_name(out) if out is not None else None,
                "promised_param_dtype": dtype_name(layer.param_dtype),
                "promised_output_dtype": dtype_name(promised_out) if promised_out is not None else None,
                "rule": layer.rule,
                "autocast": self.policy.autocast,
                "float8": is_float8(module),
                "promised_float8": layer.float8 is not None,
                "float8_skipped": layer.float8_skipped,
                **blocks_applied(module, layer),
            })
        return entries

    def broken(self, entries: list[dict[str, Any]]) -> list[str]:
        """The promises the closed audit's `entries` broke, one message each (`broken_promises`)."""
        return broken_promises(entries)


def blocks_applied(module: nn.Module, layer: LayerPlan) -> dict[str, Any]:
    """What the audit says of a block's checkpointing and compilation: what was applied, and what was planned."""
    return {"checkpoint": getattr(module, CHECKPOINTED, None), "promised_checkpoint": layer.checkpoint,
            "compiled": getattr(module, "_compiled_call_impl", None) is not None,
            "promised_compile": layer.compile}


def broken_promises(entries: list[dict[str, Any]]) -> list[str]:
    """One message per layer whose parameters or output are not in the dtype the policy promised."""
    problems = []
    for e in entries:
        if e["param_dtype"] is not None and e["param_dtype"] != e["promised_param_dtype"]:
            problems.append(f"layer '{e['name']}' ({e['type']}) stores {e['param_dtype']}, "
                            f"policy promised {e['promised_param_dtype']}")
        if e["promised_output_dtype"] is not None and e["output_dtype"] not in (None, e["promised_output_dtype"]):
            problems.append(f"layer '{e['name']}' ({e['type']}) computed in {e['output_dtype']}, "
                            f"policy promised {e['promised_output_dtype']}" + (f" (rule {e['rule']})" if e["rule"] else ""))
        if e.get("promised_float8") and not e.get("float8"):
            problems.append(f"layer '{e['name']}' ({e['type']}) computed its matmuls in {e['output_dtype']}, policy "
                            f"promised float8 (rule {e['rule']})")
        if e.get("promised_checkpoint") and e.get("checkpoint") != e["promised_checkpoint"]:
            problems.append(f"layer '{e['name']}' ({e['type']}) ran with activation checkpointing "
                            f"{e.get('checkpoint') or 'off'}, a rule promised {e['promised_checkpoint']}")
        if e.get("promised_compile") and not e.get("compiled"):
            problems.append(f"layer '{e['name']}' ({e['type']}) was not compiled, a rule promised compile: true")
    return problems
