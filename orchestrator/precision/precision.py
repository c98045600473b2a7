"""The `precision` section in force on one rank: one object for everything a step does with dtypes.

Built once per model (and again when a collapse rebuilds it) from the section, each field parsed
once (`Policy.from_config`). `prepare(model)` casts the model per the policy, keeps fp32 masters
and starts the first step's audit; then a training step reads

    with precision.forward():
        loss = loss_fn(model(inputs), targets)
    precision.backward(loss)          # scaled; gradients end where the optimizer reads them
    outcome = precision.step(optimizer, loss, step)   # guarded: stepped or skipped on every rank, on the device

and the object does the rest: autocast, the GradScaler, master-weight sync, the agreed skip, the
audit of what each layer really ran in, and the memory ledger of the first step.
"""

from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from orchestrator.precision.amp import autocast_context
from orchestrator.precision.float8 import convert_float8, float8_layers
from orchestrator.precision.float8_pays import skip_small
from orchestrator.precision.ledger import MemoryLedger
from orchestrator.precision.masters import MasterWeights, fp32_state_dict
from orchestrator.precision.policy import Audit, Policy, apply, plan
from orchestrator.precision.guarded_step import Counters, GuardedScaler, StepOutcome, clip

if TYPE_CHECKING:
    from orchestrator.precision.fsdp import FsdpAudit


class PolicyNotHonoured(RuntimeError):
    """A layer did not store or compute in the dtype its precision rule promised. `entries`: the audit (one per
    layer), which the failed run logs as `precision/audit.json` all the same."""

    def __init__(self, message: str, entries: Optional[list[dict[str, Any]]] = None):
        super().__init__(message)
        self.entries = entries

    def __reduce__(self):  # crosses from the worker to the driver with its entries
        return type(self), (str(self), self.entries)


def bf16_unsupported(policy: Policy, device: torch.device) -> Optional[str]:
    """Why this policy cannot run on `device` (a GPU without bfloat16), or None when it can."""
    if policy.uses(torch.bfloat16) and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return (f"bfloat16 asked, but {torch.cuda.get_device_name(device)} has no bfloat16 support. "
                "Use preset O1 or O2 (float16 with loss scaling).")
    return None


class Precision:
    def __init__(self, section: Any, device: torch.device, *, rank: int = 0, world_size: int = 1,
                 promoted: Sequence[str] = (), policy: Optional[Policy] = None):
        """`promoted`: layers moved to fp32 at run time (`on_collapse: promote`), ahead of every rule. `policy`: the
        section as the job built it once (`orchestrator.config.job.Job`); parsed from `section` when not given."""
        self.section, self.device = section, device
        self.policy = (policy or Policy.from_config(section)).with_promoted(promoted)
        problem = bf16_unsupported(self.policy, device)
        if problem:
            raise RuntimeError(f"precision: {problem}")
        self.guard = GuardedScaler(self.policy.amp, section.scaler, device, rank, world_size,
                                   enabled=self.policy.scaler_enabled, on_nonfinite_grads=section.on_nonfinite_grads)
        self.guard.on_settled.append(self._settled)
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self.masters: Optional[MasterWeights] = None
        self.audit: Optional[Audit] = None
        """Records the first step's output dtypes; None once closed."""
        self.ledger: Optional[MemoryLedger] = None
        self.plans: dict[str, Any] = {}
        """Each module's LayerPlan (qualified name -> plan), once `prepare` planned them."""
        self.named_tensors: list[tuple[str, torch.Tensor]] = []
        """The tensors the optimizer steps (fp32 masters where there are some), by parameter name."""

    # -- the model ----------------------------------------------------------------------------------

    def prepare(self, model: nn.Module) -> nn.Module:
        """Cast `model` (fp32, on its device, every rank's weights equal) per the policy.

        The fp32 masters are captured before the cast, so they start from the exact fp32 values.
        Apply before DDP wraps the model: the hooks belong on the modules themselves.
        """
        plans = self.plans = plan(model, self.policy)
        self.policy = skip_small(model, self.policy, plans, self.device)  # float8 only where it pays
        convert_float8(model, float8_layers(plans), self.device)  # before the hooks: it swaps the modules
        self.masters = MasterWeights(model, plans) if self.policy.master_weights else None
        apply(model, self.policy, plans, self.device.type)
        self.audit = Audit(model, self.policy, plans)
        self.ledger = MemoryLedger(model)
        self.model = model
        names = [name for name, _ in model.named_parameters()]
        self.named_tensors = list(zip(names, self.optimizer_params()))
        return model

    def prepare_sharded(self, model: nn.Module, audit: "FsdpAudit",
                        named_tensors: Sequence[tuple[str, Any]]) -> nn.Module:
        """Under FSDP: `model` was planned, cast and sharded by the strategy (`orchestrator.train.fsdp_strategy`),
        which started `audit`. No masters (the fp32 shards are); the ledger counts this rank's shards;
        `named_tensors` give this rank's gradient shards by name (the overflow log, fault drills)."""
        self.masters = None
        self.audit = audit
        self.ledger = MemoryLedger(model)
        self.model = model
        self.named_tensors = list(named_tensors)
        return model

    def optimizer_params(self) -> Iterator[torch.Tensor]:
        """What the optimizer steps: the fp32 master where there is one, else the parameter."""
        return self.masters.optimizer_params(self.model) if self.masters else self.model.parameters()

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights in fp32 on the CPU (half parameters' values from their masters)."""
        return self.masters.fp32_state_dict(self.model) if self.masters else fp32_state_dict(self.model)

    # -- the step -----------------------------------------------------------------------------------

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Autocast as the policy says; on the first step also record activations for the memory ledger."""
        with ExitStack() as stack:
            stack.enter_context(autocast_context(self.policy.amp, self.device.type))
            if self.ledger is not None and self.ledger.probe is not None:
                stack.enter_context(self.ledger.probe.recording())
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Scaled backward (DDP all-reduces the scaled gradients meanwhile); half gradients then move to the
        fp32 masters, so the gradients are where the optimizer (and the unscale) reads them."""
        self.guard.scale(loss).backward()
        if self.ledger is not None:
            self.ledger.record_backward()
        if self.masters:
            self.masters.grads_to_masters()

    def step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, step: int,
             clip_grad_norm: Optional[float] = None,
             clip_with: Callable[[torch.optim.Optimizer, Optional[float]], Optional[torch.Tensor]] = clip
             ) -> StepOutcome:
        """Step or skip, the same on every rank, decided on the device (gradients unscaled, then clipped to
        `clip_grad_norm` by `clip_with`: the strategy's); then the masters are rounded back into the model (on a
        skipped step they did not move: the model keeps its values)."""
        self._optimizer = optimizer
        outcome = self.guard.step(optimizer, loss, step, self.named_tensors, clip_grad_norm, clip_with)
        if self.masters:
            self.masters.masters_to_params()
        return outcome

    def settle(self) -> None:
        """Read every step's flags not read yet (waiting for the device): see `GuardedScaler.settle`."""
        self.guard.settle()

    def _settled(self, outcome: StepOutcome) -> None:
        """After the first step taken: the optimizer state's bytes for the memory ledger."""
        if outcome.stepped and self.ledger is not None and not self.ledger.complete and self._optimizer is not None:
            self.ledger.record_state(self._optimizer, self.masters)

    # -- the audit ----------------------------------------------------------------------------------

    @property
    def audited(self) -> bool:
        return self.audit is None

    def close_audit(self) -> Optional[list[dict[str, Any]]]:
        """After the first forward pass: what each layer really stored and computed in (None until then,
        and after). Raises PolicyNotHonoured when a layer broke its promise."""
        if self.audit is None or not self.audit.outputs:
            return None
        audit, self.audit = self.audit, None
        entries = audit.close()
        problems = audit.broken(entries)  # an FSDP audit also checks its shards
        if problems:
            raise PolicyNotHonoured("precision policy not honoured: " + "; ".join(problems), entries)
        return entries

    # -- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler and the guardrail counters (part of a train state), every step's flags read first."""
        self.guard.settle()
        return {"scaler": self.guard.scaler.state_dict(), "counters": asdict(self.guard.counters)}

    def load_state_dict(self, scaler: Optional[dict[str, Any]], counters: Optional[dict[str, Any]]) -> None:
        """Restore what `state_dict` gave; a missing scaler (a promotion) starts from a fresh scale."""
        if scaler:
            self.guard.scaler.load_state_dict(scaler)
        if counters:
            self.guard.counters = Counters(**counters)
