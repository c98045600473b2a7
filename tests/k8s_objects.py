"""Where things are in rendered k8s/ objects: the clusters, pods and containers the tests look at."""

OVERLAYS = {"gpu": "gpu", "gke": "gpu", "eks": "gpu", "cpu-smoke": "cpu", "gpu-bucket": "gpu"}  # k8s/overlays/NAME -> image variant


def one(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def ray_cluster_specs(objects):
    """(where, RayClusterSpec) for every Ray cluster: RayClusters, and RayJobs that bring their own."""
    return [(f"RayCluster/{o['metadata']['name']}", o["spec"]) for o in objects if o["kind"] == "RayCluster"] + \
           [(f"RayJob/{o['metadata']['name']}", o["spec"]["rayClusterSpec"]) for o in objects
            if o["kind"] == "RayJob" and "rayClusterSpec" in o["spec"]]


def ray_pod_specs(objects):
    """(where, PodSpec) of every Ray pod: heads and each worker group."""
    pods = []
    for where, spec in ray_cluster_specs(objects):
        pods.append((f"{where} head", spec["headGroupSpec"]["template"]["spec"]))
        pods += [(f"{where} {g['groupName']}", g["template"]["spec"]) for g in spec["workerGroupSpecs"]]
    return pods


def all_pod_specs(objects):
    """Every pod that will run: Ray pods, the RayJob submitter, Deployments and StatefulSets."""
    pods = ray_pod_specs(objects)
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            pods.append((f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"]))
        if o["kind"] == "RayJob":
            pods.append((f"RayJob/{o['metadata']['name']} submitter", o["spec"]["submitterPodTemplate"]["spec"]))
    return pods


def all_containers(objects):
    """(where, container, pod spec or None); the autoscaler sidecar KubeRay adds counts too."""
    found = [(f"{where} {c['name']}", c, pod) for where, pod in all_pod_specs(objects)
             for c in pod.get("initContainers", []) + pod["containers"]]
    for where, spec in ray_cluster_specs(objects):
        if spec.get("enableInTreeAutoscaling"):
            found.append((f"{where} autoscaler", spec["autoscalerOptions"], spec["headGroupSpec"]["template"]["spec"]))
    return found


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
