"""The probe: each layer with parameters lowered alone to each candidate dtype, on a few of the job's batches.

For every candidate layer it records, from the fp32 pass, what the layer does (`Work`: FLOPs, parameters,
activations) and its fp16 headroom (`Headroom`); then, lowered alone (the job's own policy machinery: a rule
naming that layer, applied to a copy of the model), the relative error of the model's output and of every
gradient against fp32, on the same batches. Normalisation layers stay fp32 (they are not candidates), as every
mixed-precision recipe keeps them. Layers whose outputs meet in one attention (query, key and value projections:
`orchestrator.precision.attention`) are one candidate, lowered together: one of them alone cannot run. Layers the
job's own rules decide are not candidates (`exclude`).
"""

import copy
import glob
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from omegaconf import OmegaConf
from torch import nn

from orchestrator.config.schema import PrecisionSection
from orchestrator.precision.attention import meeting_groups, producing_layers
from orchestrator.precision.dtypes import parse_dtype
from orchestrator.precision.float8 import FLOAT8, convert_float8, float8_layers, float8_linear
from orchestrator.precision.policy import Policy, apply, plan
from orchestrator.train.batch import Batch, tensors
from orchestrator.tune.devices import Work

PROBE_SEED = 0
"""The seed every pass of the probe starts from (its reference and each lowered model alike)."""
FP16_MAX = 65504.0
FP16_TINIEST = 2.0 ** -24
"""fp16's smallest subnormal: a smaller magnitude becomes 0."""
HEADROOM_BITS = 1
"""An fp16 layer's largest activation must stay this many powers of two below fp16's largest value."""
UNDERFLOW_SHARE = 0.01
"""The share of a layer's non-zero activations, or of its gradients at the best loss scale, that may flush to 0 in
fp16."""


@dataclass(frozen=True)
class Headroom:
    """A layer's fp16 headroom, from the fp32 pass."""

    max_abs_activation: float
    activation_underflow: float
    """Share of its non-zero outputs below fp16's smallest subnormal."""
    max_abs_grad: float
    grad_underflow: float
    """Share of its parameters' non-zero gradients below fp16's smallest subnormal at the largest power-of-two
    loss scale that keeps the largest one below half of fp16's maximum (what a dynamic scale settles near)."""

    @property
    def refusal(self) -> Optional[str]:
        """Why the layer has no fp16 headroom, or None when it has."""
        if not math.isfinite(self.max_abs_activation) or self.max_abs_activation >= FP16_MAX / 2 ** HEADROOM_BITS:
            return f"no fp16 headroom: activations reach {self.max_abs_activation:.3g} (fp16's largest is 65504)"
        if self.activation_underflow > UNDERFLOW_SHARE:
            return f"no fp16 headroom: {self.activation_underflow:.1%} of its activations underflow in fp16"
        if self.grad_underflow > UNDERFLOW_SHARE:
            return f"no fp16 headroom: {self.grad_underflow:.1%} of its gradients underflow in fp16 at any scale"
        return None


@dataclass
class LayerProbe:
    name: str
    type: str
    work: Work
    headroom: Headroom
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    """dtype -> (output error, gradient error) with this layer alone in that dtype."""
    inputs: Any = None
    """The layer's (args, kwargs) on the first batch, for timing it alone."""
    members: tuple[str, ...] = ()
    """The layers this candidate lowers together (an attention block's projections); empty: the layer alone."""

    @property
    def layers(self) -> tuple[str, ...]:
        return self.members or (self.name,)


def candidate_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules with parameters of their own, except the model itself and normalisation layers."""
    return producing_layers(model)


def layer_policy(layers: Optional[Sequence[str] | str], dtype: str) -> Policy:
    """fp32 everywhere (no autocast), and `layers` alone stored and computed in `dtype` (a rule naming each)."""
    layers = [layers] if isinstance(layers, str) else list(layers or [])
    rules = [{"match": glob.escape(layer), "dtype": dtype} for layer in layers]
    return Policy.from_config(OmegaConf.merge(OmegaConf.structured(PrecisionSection), {"rules": rules}))


def _merged(name: str, parts: list[LayerProbe]) -> LayerProbe:
    """One candidate for layers lowered together: their work added up, their headroom the tightest."""
    work = Work(flops=sum(p.work.flops for p in parts), params=sum(p.work.params for p in parts),
                activations=sum(p.work.activations for p in parts), matmul=all(p.work.matmul for p in parts))
    headroom = Headroom(*(max(getattr(p.headroom, key) for p in parts) for key in (
        "max_abs_activation", "activation_underflow", "max_abs_grad", "grad_underflow")))
    types = list(dict.fromkeys(p.type for p in parts))
    return LayerProbe(name=name, type="+".join(types), work=work, headroom=headroom,
                      members=tuple(p.name for p in parts))


def _flops(module: nn.Module, output: torch.Tensor) -> tuple[float, bool]:
    """Forward FLOPs of a layer that produced `output`, and whether they are matrix work."""
    if isinstance(module, nn.Linear):
        return 2.0 * module.in_features * output.numel(), True
    if isinstance(module, nn.modules.conv._ConvNd):
        per_output = 2.0 * module.in_channels // module.groups * math.prod(module.kernel_size)
        return per_output * output.numel(), True
    return 2.0 * output.numel(), False


def _underflow(values: torch.Tensor, scale: float = 1.0) -> float:
    nonzero = values[values != 0].abs().float() * scale
    return float((nonzero < FP16_TINIEST).float().mean()) if nonzero.numel() else 0.0


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    return next((t for t in tensors(value) if t.is_floating_point()), None)


class Probe:
    """The fp32 reference and each layer's sensitivity, on `batches` of the job's data."""

    def __init__(self, model: nn.Module, batches: list[Batch], loss: Callable[[Any, Any], torch.Tensor],
                 device: torch.device, exclude: Sequence[str] = ()):
        self.model, self.batches, self.loss, self.device = model.to(device).train(), batches, loss, device
        self.exclude = set(exclude)
        self.layers: dict[str, LayerProbe] = {}
        """The candidates: a layer, or the layers of an attention block lowered together."""
        self.single: dict[str, LayerProbe] = {}
        """Every candidate layer alone (what it does, its inputs for timing)."""
        self.excluded_blocks: list[str] = []
        """Attention blocks left out because the job's own rules decide some of their layers."""
        self.reference_outputs, self.reference_grads = self._profile()
        self._group()

    def _group(self) -> None:
        """The layers meeting in one attention made one candidate (in the model's order, where the first stood);
        a block part of which the job's rules decide is left out whole."""
        groups = meeting_groups(self.model, lambda model: self.batches[0].forward(model))
        first = {group.layers[0]: group for group in groups}
        grouped = {layer for group in groups for layer in group.layers}
        for name, layer in self.single.items():
            if name not in grouped:
                self.layers[name] = layer
            elif name in first:
                group = first[name]
                if self.exclude & set(group.layers):
                    self.excluded_blocks.append(group.block)
                    continue
                parts = [self.single[member] for member in group.layers if member in self.single]
                relative = ",".join(group.relative(member) for member in group.layers)
                self.layers[f"{group.block}.{{{relative}}}"] = _merged(f"{group.block}.{{{relative}}}", parts)

    def _profile(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The fp32 pass: each batch's output and gradients, and each candidate layer's work and headroom."""
        stats: dict[str, dict[str, Any]] = {}
        handles = []
        for name, module in candidate_layers(self.model):
            if name in self.exclude:
                continue
            stats[name] = {"type": type(module).__name__, "max_act": 0.0, "underflow": [], "flops": 0.0,
                           "activations": 0, "matmul": False, "inputs": None}

            def pre(module, args, kwargs, name=name):
                if stats[name]["inputs"] is None:
                    stats[name]["inputs"] = (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                                             kwargs)
                    stats[name]["input_numel"] = sum(t.numel() for t in tensors(args))

            def post(module, args, output, name=name):
                out = _first_tensor(output)
                if out is None:
                    return
                entry = stats[name]
                entry["max_act"] = max(entry["max_act"], float(out.detach().abs().max()))
                entry["underflow"].append(_underflow(out.detach()))
                if entry["flops"] == 0.0:
                    entry["flops"], entry["matmul"] = _flops(module, out)
                    entry["activations"] = entry.get("input_numel", 0) + out.numel()

            handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]
        try:
            outputs, grads = self._run(self.model)
        finally:
            for handle in handles:
                handle.remove()
        modules = dict(self.model.named_modules())
        grad_of = {id(p): g for p, g in zip(self.model.parameters(), grads)}
        for name, entry in stats.items():
            own = list(modules[name].parameters(recurse=False))
            own_grads = [grad_of[id(p)].flatten() for p in own if grad_of[id(p)] is not None]
            grad_values = torch.cat(own_grads) if own_grads else torch.zeros(0)
            max_grad = float(grad_values.abs().max()) if grad_values.numel() else 0.0
            scale = 2.0 ** math.floor(math.log2(FP16_MAX / 2 / max_grad)) if max_grad > 0 else 1.0
            self.single[name] = LayerProbe(
                name=name, type=entry["type"],
                work=Work(flops=entry["flops"], params=sum(p.numel() for p in own), activations=entry["activations"],
                          matmul=entry["matmul"]),
                headroom=Headroom(max_abs_activation=entry["max_act"],
                                  activation_underflow=max(entry["underflow"], default=0.0),
                                  max_abs_grad=max_grad, grad_underflow=_underflow(grad_values, scale)),
                inputs=entry["inputs"])
        return outputs, grads

    def _run(self, model: nn.Module) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:
        """Each batch's outputs (floating tensors, flattened, fp32) and the gradients summed over the batches (fp32,
        in the model's parameter order)."""
        model.zero_grad(set_to_none=True)
        outputs = []
        # The same random numbers on every run: dropout (a transformer's, in train mode) drops the same units in the
        # lowered model as in the reference, so the errors are the dtype's alone.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [],
                                   device_type=self.device.type):
            torch.manual_seed(PROBE_SEED)
            for batch in self.batches:
                result = batch.forward(model)
                outputs.append(torch.cat([t.detach().float().flatten() for t in tensors(result)
                                          if t.is_floating_point()]))
                self.loss(result, batch.targets).backward()
        grads = [p.grad.detach().float().clone() if p.grad is not None else None for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return outputs, grads

    def sensitivity(self, layer: str, dtype: str) -> tuple[float, float]:
        """(output error, gradient error) of the model with `layer` alone in `dtype`, relative L2 against fp32."""
        lowered = copy.deepcopy(self.model)
        policy = layer_policy(self.layers[layer].layers, dtype)
        plans = plan(lowered, policy)
        convert_float8(lowered, float8_layers(plans), self.device)
        apply(lowered, policy, plans, self.device.type)
        outputs, grads = self._run(lowered)
        error = _relative(outputs, self.reference_outputs)
        grad_error = _relative([g for g in grads if g is not None], [g for g in self.reference_grads if g is not None])
        self.layers[layer].errors[dtype] = (error, grad_error)
        return error, grad_error

    def measured_time(self, layer: str, dtype: str, budget_s: float = 0.05) -> float:
        """Seconds of the layer's forward and backward alone in `dtype` on the device at hand, the casts of its
        input from fp32 and of its output back included (the median of as many runs as fit `budget_s`, at least 5,
        after a warm-up): CUDA events on a GPU, the wall clock elsewhere. Layers lowered together: the sum of each
        alone."""
        members = self.layers[layer].members if layer in self.layers else ()
        if members:
            return sum(self.measured_time(member, dtype, budget_s / len(members)) for member in members)
        module = copy.deepcopy(dict(self.model.named_modules())[layer])
        if dtype == FLOAT8:  # fp32 weights and inputs, cast to float8 inside
            to, module = torch.float32, float8_linear(module)
        else:
            to = parse_dtype(dtype)
            module = module.to(to)
        args, kwargs = self.single[layer].inputs
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
        cuda = self.device.type == "cuda"

        def once() -> float:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            began = time.perf_counter()
            cast = tuple(a.to(to) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            out = _first_tensor(module(*cast, **kwargs)).float()
            out.backward(torch.ones_like(out))
            if cuda:
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1000
            return time.perf_counter() - began

        once()
        times = [once() for _ in range(5)]
        while sum(times) < budget_s and len(times) < 200:
            times.append(once())
        return statistics.median(times)


def _relative(values: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """||values - reference|| / ||reference|| over all the tensors (inf when not finite)."""
    num = sum(float(((v.float() - r.float()) ** 2).sum()) for v, r in zip(values, reference))
    den = sum(float((r.float() ** 2).sum()) for r in reference)
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)
