"""k8s/: every overlay renders to objects Kubernetes and KubeRay accept, wired the way the job needs.

Offline: core kinds validate against the `kubernetes-validate` schemas in strict mode; RayCluster
and RayJob against KubeRay v1.7.0's CRD schemas (vendored in k8s/schemas/), made strict the way
the API server's strict field validation treats unknown fields.
"""

import copy
import re
import shlex
import shutil
import subprocess
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from conftest import REPO
from k8s_objects import OVERLAYS, all_containers, all_pod_specs, env_of, one, ray_cluster_specs, ray_pod_specs
from k8s_render import render

K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())  # oldest we support, newest known
KUBERAY_SCHEMAS = REPO / "k8s" / "schemas" / "kuberay-v1.7.0"
SECRETS = {"ampflow-postgres": {"password"}, "ray-auth-token": {"auth_token"}}
BUCKET_SECRETS = {"ampflow-mlflow-artifacts": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3"}}
"""Referenced by the MLflow server of `gpu-bucket` where the pod has no identity of its own (each key optional)."""


@pytest.fixture(scope="module", params=list(OVERLAYS))
def overlay(request):
    objects = render(REPO / "k8s" / "overlays" / request.param)
    return request.param, objects


# --- rendering and schemas -------------------------------------------------------------------

@pytest.mark.skipif(not (shutil.which("kustomize") or shutil.which("kubectl")), reason="no kustomize binary")
@pytest.mark.parametrize("name", list(OVERLAYS))
def test_our_renderer_gives_what_kustomize_gives(name):
    tool = ["kustomize", "build"] if shutil.which("kustomize") else ["kubectl", "kustomize"]
    out = subprocess.run([*tool, str(REPO / "k8s" / "overlays" / name)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    theirs = {key(o): o for o in yaml.safe_load_all(out.stdout) if o}
    ours = {key(o): o for o in render(REPO / "k8s" / "overlays" / name)}
    assert ours == theirs


def test_core_objects_validate_strictly_against_kubernetes_schemas(overlay):
    name, objects = overlay
    core = [o for o in objects if not o["apiVersion"].startswith("ray.io/")]
    assert {o["kind"] for o in core} >= {"Deployment", "StatefulSet", "Service", "PersistentVolumeClaim"}
    for version in K8S_VERSIONS:
        for obj in core:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: "
                            f"{'.'.join(map(str, exc.caught.absolute_path))}: {exc.caught.message}")


def strict(schema):
    """An openAPIV3Schema with unknown fields refused, as `kubectl apply` (strict field validation) does."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def kuberay_validators():
    validators = {}
    for path in KUBERAY_SCHEMAS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        validators[crd["spec"]["names"]["kind"]] = jsonschema.Draft7Validator(strict(v1["schema"]["openAPIV3Schema"]))
    assert set(validators) == {"RayCluster", "RayJob"}
    return validators


def test_ray_objects_validate_strictly_against_kuberay_crds(overlay, kuberay_validators):
    name, objects = overlay
    ray = [o for o in objects if o["apiVersion"].startswith("ray.io/")]
    assert sorted(o["kind"] for o in ray) == ["RayCluster", "RayJob"]
    for obj in ray:
        assert obj["apiVersion"] == "ray.io/v1"
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in kuberay_validators[obj["kind"]].iter_errors(obj)]
        assert not errors, f"{name}: {obj['kind']}/{obj['metadata']['name']}: {errors[:5]}"


def test_the_validators_catch_a_misspelled_field(kuberay_validators):
    objects = render(REPO / "k8s" / "overlays" / "gpu")
    job = copy.deepcopy(one(objects, "RayJob"))
    job["spec"]["shutdownAfterJobFinish"] = True  # missing "es"
    assert not kuberay_validators["RayJob"].is_valid(job)
    deployment = copy.deepcopy(one(objects, "Deployment", "mlflow"))
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # missing "s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


# --- consistency with the project ------------------------------------------------------------

def entrypoint(objects):
    argv = shlex.split(one(objects, "RayJob")["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "orchestrator.submit"], argv
    return argv[3], argv[4:]


def test_the_rayjob_runs_a_job_file_of_this_project_with_valid_overrides(overlay):
    from orchestrator.config import load_job

    name, objects = overlay
    job_file, overrides = entrypoint(objects)
    assert job_file == {"gpu": "jobs/cifar.yaml", "cpu": "jobs/quickstart.yaml"}[OVERLAYS[name]]
    assert (REPO / job_file).is_file()
    load_job(REPO / job_file, overrides, base_dir=REPO)  # unknown keys or bad values raise BadInput


def test_the_job_fits_the_cluster_it_runs_on(overlay):
    from orchestrator.config import load_job

    name, objects = overlay
    job_file, overrides = entrypoint(objects)
    cfg = load_job(REPO / job_file, overrides, base_dir=REPO)
    (workers,) = one(objects, "RayCluster")["spec"]["workerGroupSpecs"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    assert workers["maxReplicas"] >= cfg.scaling.num_workers, "the autoscaler could never add enough workers"
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    wanted = dict(cfg.scaling.resources_per_worker) or {"CPU": 1, "GPU": 1 if cfg.scaling.use_gpu else 0}
    assert float(limits["cpu"]) >= wanted.get("CPU", 1)
    assert int(limits.get("nvidia.com/gpu", 0)) >= wanted.get("GPU", 0)
    gpu_asked = [where for where, c, _ in all_containers(objects) if "nvidia.com/gpu" in c["resources"]["limits"]]
    assert bool(gpu_asked) == (OVERLAYS[name] == "gpu"), gpu_asked


def shared_mount(pod):
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    (path,) = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if claims.get(m["name"]) == "ampflow-shared"]
    return path


def test_data_and_checkpoints_go_to_the_volume_every_ray_pod_shares(overlay):
    _, objects = overlay
    mounts = {shared_mount(pod) for _, pod in ray_pod_specs(objects)}
    assert len(mounts) == 1, f"ampflow-shared must be mounted at one path in every Ray pod, got {mounts}"
    (mount,) = mounts
    settings = dict(o.split("=", 1) for o in entrypoint(objects)[1])
    assert settings["data.root"].startswith(mount + "/")
    assert settings["checkpoint.storage_path"].startswith(mount + "/")


def pins():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ray = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "ray")
    return ray.specifier, SpecifierSet(project["requires-python"])


def ray_base_images():
    """Every rayproject/ray tag the Dockerfile and the deploy guide name, as (version, python, variant)."""
    import re

    text = (REPO / "k8s" / "Dockerfile").read_text() + (REPO / "docs" / "deploy.md").read_text()
    found = re.findall(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)(-gpu)?\b", text)
    return {(version, f"{major}.{minor}", "gpu" if gpu else "cpu") for version, major, minor, gpu in found}


def test_ray_image_tags_match_the_pinned_ray_and_python(overlay):
    name, objects = overlay
    ray_spec, python_spec = pins()
    bases = ray_base_images()
    assert {variant for _, _, variant in bases} == {"gpu", "cpu"}
    (version,) = {v for v, _, _ in bases}
    (python,) = {p for _, p, _ in bases}
    assert version in ray_spec, f"rayproject/ray:{version} does not satisfy pyproject's ray{ray_spec}"
    assert python in python_spec and python == "3.11"
    assert "ARG RAY_IMAGE=rayproject/ray:" + version + "-py311-gpu" in (REPO / "k8s" / "Dockerfile").read_text()

    expected = f"ray{version}-py{python.replace('.', '')}-{OVERLAYS[name]}"
    for where, container, _ in all_containers(objects):
        image = container.get("image")
        if image and not image.startswith("postgres:"):  # the autoscaler without `image` runs the head's
            # docs/deploy.md tags each build with its commit: ray2.60.0-py311-gpu-1a2b3c4
            assert re.fullmatch(re.escape(expected) + r"(-[0-9a-f]{7,40})?", image.rsplit(":", 1)[1]), \
                f"{name}: {where} runs {image}, expected tag {expected}[-COMMIT]"
    assert "TAG=" + expected + "-$(git rev-parse --short HEAD)" in (REPO / "docs" / "deploy.md").read_text() \
        or OVERLAYS[name] != "gpu"
    for where, spec in ray_cluster_specs(objects):
        assert spec["rayVersion"] == version, where


def test_the_rayjob_ships_the_images_project_directory_and_gives_a_stop_time_to_close_the_run():
    dockerfile = (REPO / "k8s" / "Dockerfile").read_text()
    (workdir,) = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("WORKDIR ")]
    for directory in ("orchestrator", "configs", "jobs"):
        assert f"COPY --chown=1000:100 {directory} ./{directory}" in dockerfile
    for name in OVERLAYS:
        job = one(render(REPO / "k8s" / "overlays" / name), "RayJob")
        from orchestrator.runner.remote import STOP_GRACE_ENV

        assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == {"working_dir": workdir, "env_vars": STOP_GRACE_ENV}


def test_every_ray_pod_reports_to_the_mlflow_service(overlay):
    _, objects = overlay
    service = one(objects, "Service", "mlflow")
    (port,) = service["spec"]["ports"]
    deployment = one(objects, "Deployment", "mlflow")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert port["targetPort"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    uri = f"http://{service['metadata']['name']}:{port['port']}"
    for where, pod_spec in ray_pod_specs(objects):
        for container in pod_spec["containers"]:
            assert env_of(container).get("MLFLOW_TRACKING_URI") == uri, f"{where} {container['name']}"


def test_every_ray_pod_polls_reports_as_often_as_a_local_submit(overlay):
    from orchestrator.runner.ray_start import HEALTH_CHECK_INTERVAL_S

    _, objects = overlay
    for where, pod_spec in ray_pod_specs(objects):
        for container in pod_spec["containers"]:
            interval = env_of(container).get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
            assert interval is not None and float(interval) == HEALTH_CHECK_INTERVAL_S, f"{where} {container['name']}"


def is_the_shared_volume_owner_fix(where, container, pod):
    """The one root container (gke overlay): an init container of the head that only hands the shared
    volume's root to the pods' user, with CHOWN and FOWNER and nothing else."""
    context = container.get("securityContext", {})
    return (container.get("name") == "shared-volume-owner" and where.endswith(" head shared-volume-owner")
            and container in pod.get("initContainers", [])
            and context == {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}}
            and container["command"][:2] == ["sh", "-c"]
            and set(re.findall(r"\b(chown|chmod|rm|mv|cp|curl|wget|python)\b", container["command"][2])) == {"chown", "chmod"}
            and [m["mountPath"] for m in container["volumeMounts"]] == ["/mnt/shared"])


def test_every_container_has_requests_and_limits_and_runs_unprivileged_as_non_root(overlay):
    name, objects = overlay
    for where, container, pod in all_containers(objects):
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{name}: {where} lacks {kind}"
        if is_the_shared_volume_owner_fix(where, container, pod):
            assert name == "gke", f"{name}: only the gke overlay needs a root init container"
            continue
        pod_context, context = pod.get("securityContext", {}), container.get("securityContext", {})
        assert context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True, f"{name}: {where}"
        assert context.get("runAsUser", pod_context.get("runAsUser", 1)) != 0, f"{name}: {where}"
        assert context.get("allowPrivilegeEscalation") is False, f"{name}: {where}"
        assert not context.get("privileged") and context.get("capabilities", {}).get("drop") == ["ALL"], where
    for where, pod in all_pod_specs(objects):
        assert not pod.get("hostNetwork") and not pod.get("hostPID"), where


def test_ray_token_auth_is_on_with_the_token_from_the_secret(overlay):
    _, objects = overlay
    from_secret = {"secretKeyRef": {"name": "ray-auth-token", "key": "auth_token"}}
    for where, spec in ray_cluster_specs(objects):
        assert spec["authOptions"] == {"mode": "token", "secretName": "ray-auth-token"}, where
    # Ray's own processes: head, workers, autoscaler and the submitter (`ray job submit`), not init containers.
    ray_containers = [(where, c) for where, c, pod in all_containers(objects)
                      if where.startswith(("RayCluster/", "RayJob/")) and c not in pod.get("initContainers", [])]
    assert len(ray_containers) == 4
    for where, container in ray_containers:
        env = env_of(container)
        assert env.get("RAY_AUTH_MODE") == "token" and env.get("RAY_AUTH_TOKEN") == from_secret, where


def test_secrets_are_referenced_never_committed(overlay):
    name, objects = overlay
    assert not [o for o in objects if o["kind"] == "Secret"]
    for path in (REPO / "k8s").rglob("*.yaml"):
        if "schemas" not in path.parts:
            assert "kind: Secret" not in path.read_text(), path
    referenced = {}

    def walk(node):
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                referenced.setdefault(node["secretKeyRef"]["name"], set()).add(node["secretKeyRef"]["key"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objects)
    expected = {**SECRETS, **BUCKET_SECRETS} if name == "gpu-bucket" else SECRETS
    assert referenced == expected
    guide = (REPO / "docs" / "deploy.md").read_text()
    for secret, keys in expected.items():
        assert f"kubectl create secret generic {secret}" in guide and f"--from-literal={next(iter(keys))}=" in guide


def test_nothing_is_exposed_outside_the_cluster(overlay):
    _, objects = overlay
    assert not [o for o in objects if o["kind"] in ("Ingress", "Route", "Gateway", "HTTPRoute")]
    for service in (o for o in objects if o["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service["metadata"]["name"]
    for where, spec in ray_cluster_specs(objects):
        assert spec["headGroupSpec"]["serviceType"] == "ClusterIP" and not spec["headGroupSpec"].get("enableIngress")
    for where, container, _ in all_containers(objects):
        assert not any("hostPort" in p for p in container.get("ports", [])), where


def test_the_rayjob_runs_on_the_raycluster_so_one_head_serves_both(overlay):
    _, objects = overlay
    job = one(objects, "RayJob")["spec"]
    assert "rayClusterSpec" not in job, "a RayJob with a cluster of its own runs a second head"
    assert job["clusterSelector"] == {"ray.io/cluster": one(objects, "RayCluster")["metadata"]["name"]}
    (head,) = [pod for where, pod in ray_pod_specs(objects) if where.endswith(" head")]
    assert head is not None


def test_the_rayjob_lifecycle_is_chosen(overlay):
    _, objects = overlay
    spec = one(objects, "RayJob")["spec"]
    # KubeRay rejects a TTL without shutdownAfterJobFinishes, and never deletes a selected cluster: the
    # autoscaler frees the GPUs (idleTimeoutSeconds) instead.
    assert spec["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in spec
    assert one(objects, "RayCluster")["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] <= 900
    # A head that never gets ready fails the job early; the whole run has a longer bound.
    assert 0 < spec["preRunningDeadlineSeconds"] < spec["activeDeadlineSeconds"]
    assert spec["backoffLimit"] == 0  # a retry restarts training and its MLflow run from scratch


def test_the_bucket_overlay_keeps_mlflows_artifacts_in_a_bucket_with_no_volume_and_an_image_that_can_reach_it():
    objects = render(REPO / "k8s" / "overlays" / "gpu-bucket")
    assert not [o for o in objects
                if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "mlflow-artifacts"]
    pod = one(objects, "Deployment", "mlflow")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "volumes" not in pod and "volumeMounts" not in container
    command = container["command"]
    assert command[command.index("--artifacts-destination") + 1].startswith(("s3://", "gs://"))
    assert "MLFLOW_ARTIFACTS_DESTINATION" not in {entry["name"] for entry in container["env"]}
    assert one(objects, "ServiceAccount", pod["serviceAccountName"])  # the pod's identity towards the bucket
    for entry in container["env"]:  # credentials from a Secret only where there is no identity: all optional
        if entry.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "ampflow-mlflow-artifacts":
            assert entry["valueFrom"]["secretKeyRef"]["optional"] is True
    # Everything else is the gpu overlay's, unchanged.
    gpu = {(o["kind"], o["metadata"]["name"]) for o in render(REPO / "k8s" / "overlays" / "gpu")}
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} == \
        gpu - {("PersistentVolumeClaim", "mlflow-artifacts")} | {("ServiceAccount", "ampflow-mlflow")}
    dockerfile = (REPO / "k8s" / "Dockerfile").read_text()
    assert "boto3" in dockerfile and "google-cloud-storage" in dockerfile and "import" in dockerfile


def test_ray_workers_get_the_time_to_checkpoint_on_an_eviction_notice(overlay):
    """Kubernetes SIGKILLs a pod `terminationGracePeriodSeconds` after its SIGTERM: the workers need the job's
    `failure.preemption_grace_s` to checkpoint, and a few seconds more to hand the checkpoint over."""
    from orchestrator.config import load_job
    from orchestrator.config.schema import FailureSection

    name, objects = overlay
    job_file, overrides = entrypoint(objects)
    grace_s = load_job(REPO / job_file, overrides, base_dir=REPO).failure.preemption_grace_s
    assert grace_s == FailureSection().preemption_grace_s  # the default the manifests are made for
    for where, spec in ray_pod_specs(objects):
        if "head" in where:
            continue
        assert spec["terminationGracePeriodSeconds"] >= grace_s + 5, where  # said, not Kubernetes' default
