"""Kubernetes resource quantities as numbers: CPU in cores, memory in bytes ("500m" -> 0.5, "1Gi" -> 2**30)."""

import re

SUFFIXES = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(value))
    if not match:
        raise ValueError(f"not a Kubernetes quantity this parser knows: {value!r}")
    return float(match.group(1)) * SUFFIXES[match.group(2) or ""]


def pod_requests(pod: dict, extra_containers=()) -> dict:
    """What the scheduler reserves for a pod: the sum over its containers, or its largest init container if
    that is more (init containers run one at a time, before the others). `extra_containers`: sidecars an
    operator adds, e.g. KubeRay's autoscaler."""
    def total(containers):
        return {r: sum(quantity(c["resources"]["requests"].get(r, 0)) for c in containers) for r in ("cpu", "memory")}

    running = total([*pod["containers"], *extra_containers])
    for init in pod.get("initContainers", []):
        one = total([init])
        running = {r: max(running[r], one[r]) for r in running}
    return running
