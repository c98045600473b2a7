"""Render a kustomization the way `kubectl kustomize` does, for the subset k8s/ uses.

CI has no kustomize binary for certain, so the manifest tests render overlays with this; where
`kubectl` (or `kustomize`) is on PATH, a test checks that both give the same objects.

Supported, exactly as kustomize applies them: `resources` (files and directories holding a
kustomization), `namespace`, `labels` (pairs added to metadata.labels only), `images` (name,
newName, newTag, on every `containers`/`initContainers` list, CRDs included) and `patches`
with a target kind/name and JSON 6902 operations add, remove and replace (inline or from a
file), or a strategic-merge patch that is only `$patch: delete` (the target object goes). Anything else is refused, so an overlay cannot silently use a feature rendered wrongly here.
"""

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}


class Unsupported(Exception):
    pass


def render(directory: Path) -> list[dict]:
    directory = Path(directory)
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise Unsupported(f"{directory}/kustomization.yaml uses {sorted(unknown)}, which tests/k8s_render.py "
                          "does not render: extend it (and its kubectl comparison test) or avoid the feature.")
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            # Deep copies: YAML anchors load as shared objects, which a patch must not change twice.
            objects += [copy.deepcopy(doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        _apply_patch(objects, patch, directory)
    if "namespace" in kustomization:
        for obj in objects:
            obj["metadata"]["namespace"] = kustomization["namespace"]
    for label_set in kustomization.get("labels", []):
        if label_set.get("includeSelectors") or label_set.get("includeTemplates"):
            raise Unsupported(f"{directory}: labels with includeSelectors/includeTemplates")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label_set["pairs"])
    for image in kustomization.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _apply_patch(objects: list[dict], patch: dict, directory: Path) -> None:
    if set(patch) - {"path", "patch", "target"} or set(patch.get("target", {})) - {"kind", "name"}:
        raise Unsupported(f"{directory}: patch {patch} (only target kind/name with JSON 6902 ops)")
    text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
    operations = yaml.safe_load(text)
    target = patch["target"]
    if isinstance(operations, dict) and operations.get("$patch") == "delete":
        if (operations.get("kind"), operations.get("metadata", {}).get("name")) != (target["kind"], target["name"]):
            raise Unsupported(f"{directory}: a delete patch must name its target's kind and name")
        kept = [obj for obj in objects if (obj["kind"], obj["metadata"]["name"]) != (target["kind"], target["name"])]
        if len(kept) == len(objects):
            raise ValueError(f"{directory}: patch target {target} matches no resource")
        objects[:] = kept
        return
    if not isinstance(operations, list):
        raise Unsupported(f"{directory}: strategic-merge patch {patch}; use JSON 6902 operations")
    matched = [obj for obj in objects if obj["kind"] == target["kind"] and obj["metadata"]["name"] == target["name"]]
    if not matched:
        raise ValueError(f"{directory}: patch target {target} matches no resource")
    for obj in matched:
        for operation in operations:
            _json_patch(obj, operation)


def _json_patch(obj: dict, operation: dict) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
    parent = obj
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last, op = parts[-1], operation["op"]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op == "add":
            parent.insert(index, copy.deepcopy(operation["value"]))
        elif op == "replace":
            parent[index] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del parent[index]
        else:
            raise Unsupported(f"JSON patch op {op}")
        return
    if op in ("replace", "remove") and last not in parent:
        raise KeyError(f"JSON patch {operation}: {operation['path']} does not exist")
    if op in ("add", "replace"):
        parent[last] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del parent[last]
    else:
        raise Unsupported(f"JSON patch op {op}")


def _set_image(node: Any, image: dict) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    container["image"] = _new_image(container.get("image", ""), image)
            _set_image(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_image(item, image)


def _new_image(current: str, image: dict) -> str:
    name, _, tag = current.rpartition(":")
    if not name or "/" in tag:  # no tag; a colon in `host:port/name` is not one
        name, tag = current, ""
    if name != image["name"] or "@" in current:
        return current
    tag = image.get("newTag", tag)
    return f"{image.get('newName', name)}:{tag}" if tag else image.get("newName", name)
