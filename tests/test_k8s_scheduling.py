"""k8s/: pods land on nodes that can take them, start in order, and write to volumes that bind.

GPU nodes take only GPU workers; each Ray group's object store fits its in-memory /dev/shm; MLflow
waits for PostgreSQL and the RayJob's submitter for MLflow; the gke and eks overlays name storage
classes a new cluster has (or that they bring) and that the pods' user can write to.
"""

import pytest

from conftest import REPO
from k8s_objects import OVERLAYS, all_pod_specs, env_of, one, ray_cluster_specs
from k8s_quantities import quantity
from k8s_render import render


@pytest.fixture(scope="module", params=list(OVERLAYS))
def overlay(request):
    return request.param, render(REPO / "k8s" / "overlays" / request.param)


def tolerates_gpu_taint(pod):
    return any(t.get("key") in ("nvidia.com/gpu", None) and t.get("operator") in ("Exists", "Equal", None)
               and t.get("effect") in ("NoSchedule", None) for t in pod.get("tolerations", []))


def asks_for_gpu(pod):
    return any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in pod["containers"])


OFF_GPU_NODES = [{"key": "cloud.google.com/gke-accelerator", "operator": "DoesNotExist"},
                 {"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}]


def test_gpu_nodes_take_only_gpu_workers(overlay):
    """GPU pools carry the nvidia.com/gpu:NoSchedule taint (GKE sets it, eksctl is told to): GPU workers
    tolerate it; heads, the submitter, MLflow and PostgreSQL do not, and also avoid untainted GPU nodes."""
    name, objects = overlay
    for where, pod in all_pod_specs(objects):
        if asks_for_gpu(pod):
            assert tolerates_gpu_taint(pod), f"{name}: {where} asks for a GPU but does not tolerate the GPU taint"
        elif " head" in where or " submitter" in where or where.startswith(("Deployment/", "StatefulSet/")):
            assert not tolerates_gpu_taint(pod), f"{name}: {where} would be let onto GPU nodes"
            terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert terms["nodeSelectorTerms"] == [{"matchExpressions": OFF_GPU_NODES}], f"{name}: {where}"
    assert any(asks_for_gpu(pod) for _, pod in all_pod_specs(objects)) == (OVERLAYS[name] == "gpu")


def test_the_object_store_fits_in_dev_shm_and_dev_shm_in_the_memory_limit(overlay):
    """Ray puts its object store in /tmp (slow) when /dev/shm is smaller; an in-memory /dev/shm counts
    against the container's memory limit, so it must leave the processes most of it."""
    name, objects = overlay
    for where, spec in ray_cluster_specs(objects):
        groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
        for group, group_spec in groups:
            pod = group_spec["template"]["spec"]
            store = quantity(group_spec["rayStartParams"]["object-store-memory"])
            (shm,) = [v for v in pod["volumes"] if v["name"] in
                      {m["name"] for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"}]
            assert shm["emptyDir"]["medium"] == "Memory", f"{name}: {where} {group}"
            shm_size = quantity(shm["emptyDir"]["sizeLimit"])
            limit = quantity(pod["containers"][0]["resources"]["limits"]["memory"])
            assert store <= shm_size <= limit / 2, f"{name}: {where} {group}: store {store:g}, /dev/shm {shm_size:g}"


def test_mlflow_waits_for_postgresql_and_the_job_for_mlflow(overlay):
    _, objects = overlay
    postgres = one(objects, "Service", "postgres")["spec"]["ports"][0]["port"]
    (wait_db,) = one(objects, "Deployment", "mlflow")["spec"]["template"]["spec"]["initContainers"]
    assert "pg_isready" in " ".join(wait_db["command"])
    assert (env_of(wait_db)["PGHOST"], int(env_of(wait_db)["PGPORT"])) == ("postgres", postgres)
    submitter = one(objects, "RayJob")["spec"]["submitterPodTemplate"]["spec"]
    (wait_mlflow,) = submitter["initContainers"]
    mlflow_port = one(objects, "Service", "mlflow")["spec"]["ports"][0]["port"]
    assert env_of(wait_mlflow)["MLFLOW_TRACKING_URI"] == f"http://mlflow:{mlflow_port}"
    assert "/health" in " ".join(wait_mlflow["command"])


# --- storage on the clouds -------------------------------------------------------------------

def claims(objects):
    """storage class and size of every volume claim, the StatefulSet's template included"""
    found = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    for o in objects:
        if o["kind"] == "StatefulSet":
            found.update({f"{o['metadata']['name']}/{t['metadata']['name']}": t["spec"]
                          for t in o["spec"].get("volumeClaimTemplates", [])})
    return found


@pytest.mark.parametrize("name", ["gke", "eks"])
def test_cloud_overlays_name_storage_classes_the_pods_can_write_to(name):
    """A new GKE or EKS cluster has no ReadWriteMany default class (EKS 1.30+ no default at all), and
    fsGroup does not apply to NFS-like volumes: each claim names a class, and uid 1000 can write."""
    objects = render(REPO / "k8s" / "overlays" / name)
    volumes = claims(objects)
    assert set(volumes) == {"ampflow-shared", "mlflow-artifacts", "postgres/data"}
    assert all(spec.get("storageClassName") for spec in volumes.values()), volumes
    head = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    user = (head["securityContext"]["runAsUser"], head["securityContext"]["runAsGroup"])
    if name == "gke":
        assert volumes["ampflow-shared"]["storageClassName"] == "standard-rwx"  # Filestore CSI driver's class
        assert quantity(volumes["ampflow-shared"]["resources"]["requests"]["storage"]) >= 2**40  # its minimum
        assert {volumes[v]["storageClassName"] for v in ("mlflow-artifacts", "postgres/data")} == {"standard-rwo"}
        (owner,) = head["initContainers"]
        assert f"chown {user[0]}:{user[1]} /mnt/shared" in owner["command"][2]
    else:
        classes = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StorageClass"}
        assert "namespace" not in classes["ampflow-efs"]["metadata"]  # cluster-wide objects
        shared = classes[volumes["ampflow-shared"]["storageClassName"]]
        assert shared["provisioner"] == "efs.csi.aws.com" and shared["parameters"]["provisioningMode"] == "efs-ap"
        assert (int(shared["parameters"]["uid"]), int(shared["parameters"]["gid"])) == user
        for volume in ("mlflow-artifacts", "postgres/data"):
            disk = classes[volumes[volume]["storageClassName"]]
            assert disk["provisioner"] == "ebs.csi.aws.com" and disk["parameters"]["type"] == "gp3"
            assert disk["volumeBindingMode"] == "WaitForFirstConsumer"  # the disk in the zone of the pod's node
