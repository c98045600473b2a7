"""The choice of a per-layer policy from a sensitivity table: plain functions over plain rows, no model.

Each row is one layer in one dtype: the relative error it adds to the model's output and to the gradients when
that layer alone is lowered, and its cost. Errors of different layers are taken as independent: the predicted
error of an assignment is the root sum of squares of its layers' errors (fp32 adds none).
"""

import math
from dataclasses import dataclass
from typing import Iterable, Optional

FP32 = "float32"


@dataclass(frozen=True)
class Option:
    """One layer in one dtype: a row of the sensitivity table."""

    layer: str
    dtype: str
    output_error: float
    """Relative L2 error of the model's output with this layer alone in `dtype` (0 for fp32)."""
    grad_error: float
    """Relative L2 error of all the gradients with this layer alone in `dtype` (0 for fp32)."""
    cost: float
    """Seconds of the layer's forward and backward in `dtype` (measured or modelled)."""
    refused: Optional[str] = None
    """Why the layer may not be put in `dtype` (no fp16 headroom, not finite, not native to the target), if so."""

    @property
    def allowed(self) -> bool:
        return self.refused is None and math.isfinite(self.output_error) and math.isfinite(self.grad_error)


def by_layer(options: Iterable[Option]) -> dict[str, dict[str, Option]]:
    """layer -> dtype -> option, in the table's order."""
    table: dict[str, dict[str, Option]] = {}
    for option in options:
        table.setdefault(option.layer, {})[option.dtype] = option
    return table


def predicted_error(assignment: dict[str, str], table: dict[str, dict[str, Option]]) -> tuple[float, float]:
    """(output error, gradient error) predicted for `assignment` (layer -> dtype)."""
    chosen = [table[layer][dtype] for layer, dtype in assignment.items()]
    return (math.sqrt(sum(o.output_error ** 2 for o in chosen)), math.sqrt(sum(o.grad_error ** 2 for o in chosen)))


def cost(assignment: dict[str, str], table: dict[str, dict[str, Option]]) -> float:
    return sum(table[layer][dtype].cost for layer, dtype in assignment.items())


def choose(options: Iterable[Option], tolerance: float, pinned: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The cheapest assignment found whose predicted errors both stay within `tolerance`: from all-fp32, the move
    (a layer to a cheaper allowed dtype) that saves the most time per unit of error budget it spends, as long as
    one fits; a move that costs no error is taken first. `pinned`: layers whose dtype is decided (a validation
    moved them up), never moved."""
    table = by_layer(options)
    pinned = dict(pinned or {})
    assignment = {layer: pinned.get(layer, FP32) for layer in table}
    budget = tolerance ** 2
    while True:
        spent_out, spent_grad = (e ** 2 for e in predicted_error(assignment, table))
        best, best_value = None, 0.0
        for layer, dtypes in table.items():
            if layer in pinned:
                continue
            current = dtypes[assignment[layer]]
            for option in dtypes.values():
                saving = current.cost - option.cost
                if not option.allowed or saving <= 0:
                    continue
                out = spent_out - current.output_error ** 2 + option.output_error ** 2
                grad = spent_grad - current.grad_error ** 2 + option.grad_error ** 2
                if out > budget or grad > budget:
                    continue
                spends = max(out - spent_out, grad - spent_grad, 0.0)
                value = math.inf if spends == 0 else saving / spends
                if best is None or value > best_value:
                    best, best_value = option, value
        if best is None:
            return assignment
        assignment[best.layer] = best.dtype


def riskiest(assignment: dict[str, str], table: dict[str, dict[str, Option]], exclude: Iterable[str] = ()) -> Optional[str]:
    """The lowered layer adding the most error (output or gradient), or None when none is lowered."""
    lowered = [layer for layer, dtype in assignment.items() if dtype != FP32 and layer not in set(exclude)]
    if not lowered:
        return None
    return max(lowered, key=lambda layer: max(table[layer][assignment[layer]].output_error,
                                              table[layer][assignment[layer]].grad_error))


def one_up(layer: str, dtype: str, table: dict[str, dict[str, Option]]) -> str:
    """The dtype one step up from `dtype` for `layer`: the cheapest allowed dtype that adds less error, else fp32."""
    current = table[layer][dtype]
    error = max(current.output_error, current.grad_error)
    safer = [o for o in table[layer].values()
             if o.allowed and o.dtype != FP32 and max(o.output_error, o.grad_error) < error]
    return min(safer, key=lambda o: o.cost).dtype if safer else FP32
