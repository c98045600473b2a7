"""Every overlay's pods fit the nodes docs/deploy.md tells the user to create.

The guide's "Node shapes" table gives, per overlay and node pool, the machine type, its allocatable
CPU and memory (what the kubelet leaves to pods), what the cloud's own daemonsets and add-ons hold
on it, and how many nodes the pool has. Requests are read from the rendered manifests: a pod that
asks for more than a node offers stays Pending, and the RayJob waits until its deadline.
"""

import re

import pytest

from conftest import REPO
from k8s_objects import OVERLAYS
from k8s_quantities import pod_requests, quantity
from k8s_render import render

GUIDE = REPO / "docs" / "deploy.md"
COVERED_BY = {"gpu": ("gke", "eks"), "gke": ("gke",), "eks": ("eks",), "cpu-smoke": ("cpu-smoke",),
              "gpu-bucket": ("gke", "eks")}


def node_shapes() -> list[dict]:
    lines = GUIDE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| overlay | pool | machine |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = dict(zip(header, (cell.strip().strip("`") for cell in line.strip("|").split("|"))))
        system_cpu, system_memory = (part.strip() for part in row["held by system pods"].split("/"))
        rows.append({"overlay": row["overlay"], "pool": row["pool"], "machine": row["machine"],
                     "cpu": quantity(row["allocatable CPU"]) - quantity(system_cpu),
                     "memory": quantity(row["allocatable memory"]) - quantity(system_memory),
                     "nodes": int(row["nodes"])})
    assert rows, f"{GUIDE}: the node shapes table has no rows"
    return rows


def pods(objects) -> list[tuple[str, dict, int]]:
    """(name, requests, GPUs) of every pod the overlay runs at its largest: workers at maxReplicas."""
    found = []
    for o in objects:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "RayCluster":
            spec = o["spec"]
            sidecar = [spec["autoscalerOptions"]] if spec.get("enableInTreeAutoscaling") else []
            found.append((f"{name} head", pod_requests(spec["headGroupSpec"]["template"]["spec"], sidecar), 0))
            for group in spec["workerGroupSpecs"]:
                pod = group["template"]["spec"]
                gpus = sum(int(c["resources"]["requests"].get("nvidia.com/gpu", 0)) for c in pod["containers"])
                found += [(f"{name} {group['groupName']} {i}", pod_requests(pod), gpus) for i in range(group["maxReplicas"])]
        elif o["kind"] == "RayJob":
            found.append((f"{name} submitter", pod_requests(o["spec"]["submitterPodTemplate"]["spec"]), 0))
        elif o["kind"] in ("Deployment", "StatefulSet"):
            found += [(name, pod_requests(o["spec"]["template"]["spec"]), 0)] * o["spec"].get("replicas", 1)
    return found


def pack(pods_to_place, shape) -> list[str]:
    """First-fit decreasing onto shape['nodes'] nodes; returns the pods that found no room."""
    free = [{"cpu": shape["cpu"], "memory": shape["memory"]} for _ in range(shape["nodes"])]
    left = []
    for name, asks, _ in sorted(pods_to_place, key=lambda p: (p[1]["cpu"], p[1]["memory"]), reverse=True):
        node = next((n for n in free if asks["cpu"] <= n["cpu"] and asks["memory"] <= n["memory"]), None)
        if node is None:
            left.append(f"{name} ({asks['cpu']:g} CPU, {asks['memory'] / 2**30:g} GiB)")
            continue
        node["cpu"] -= asks["cpu"]
        node["memory"] -= asks["memory"]
    return left


@pytest.mark.parametrize("overlay", list(COVERED_BY))
def test_the_overlay_fits_the_node_shapes_the_guide_names(overlay):
    everything = pods(render(REPO / "k8s" / "overlays" / overlay))
    gpu_pods = [p for p in everything if p[2]]
    cpu_pods = [p for p in everything if not p[2]]
    shapes = [s for s in node_shapes() if s["overlay"] in COVERED_BY[overlay]]
    assert shapes, f"docs/deploy.md names no node shape for the {overlay} overlay"
    for cloud in COVERED_BY[overlay]:
        pools = {s["pool"] for s in shapes if s["overlay"] == cloud}
        assert pools in ({"cpu", "gpu"}, {"all"}), f"{cloud}: pools {pools}"
    for shape in shapes:
        where = f"{overlay} on {shape['overlay']} {shape['pool']} pool of {shape['nodes']} x {shape['machine']}"
        if shape["pool"] == "gpu":
            assert all(gpus == 1 for _, _, gpus in gpu_pods), "one GPU per worker, one worker per GPU node"
            assert not pack(gpu_pods, shape), f"{where}: GPU workers do not fit: {pack(gpu_pods, shape)}"
        else:
            placed = cpu_pods if shape["pool"] == "cpu" else everything
            assert not pack(placed, shape), f"{where}: no room for {pack(placed, shape)}"


def test_every_overlay_is_checked():
    assert set(COVERED_BY) == set(OVERLAYS)


def test_the_fit_check_refuses_a_worker_too_big_for_an_8_vcpu_node():
    """The old workers (8 CPU, 32 GiB) fitted no common GPU node; the check must say so."""
    (g5,) = [s for s in node_shapes() if s["machine"] == "g5.2xlarge"]
    too_big = [("worker", {"cpu": 8.0, "memory": 32 * 2**30}, 1)]
    assert pack(too_big, g5) == ["worker (8 CPU, 32 GiB)"]


def test_the_guide_creates_the_node_pools_it_lists():
    """Each machine type in the table appears in a command the guide gives."""
    text = GUIDE.read_text()
    commands = "\n".join(re.findall(r"```(?:bash|yaml)\n(.*?)```", text, flags=re.S))
    for shape in node_shapes():
        machine = shape["machine"]
        if not machine.startswith("kind"):
            assert machine in commands, f"docs/deploy.md lists {machine} but no command creates it"
