"""deploy/kubernetes/ read as data: every manifest is valid for pinned Kubernetes versions (the
schemas that kubernetes-validate ships, strict: an unknown field is an error; no network), and
the objects agree with each other, with the image and with what the gradstar commands read."""

from __future__ import annotations

import copy
import itertools
import re
import shlex
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, major_minor

from gradstar.config import CoordinatorSettings, ShardSettings
from gradstar.coordinator.server import SERVICE_NAMES
from gradstar.wire import COLLECTIVE_SERVICE

from .compose import ROOT, load_compose
from .conftest import GRADSTAR, clean_env

DEPLOY = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are meant for (gRPC probes are GA since 1.27), and the
# newest whose schemas the pinned kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.30", "1.37")
SECRET_KEYS = {"GRADSTAR_TOKEN_FILE": "token", "GRADSTAR_ADMIN_TOKEN_FILE": "admin-token"}


def _documents(folder: Path = DEPLOY) -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))
                 if doc is not None]
    return docs


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    found: dict[tuple[str, str], dict] = {}
    for _, doc in _documents():
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in found, f"{key} is defined twice"
        found[key] = doc
    return found


@pytest.fixture(scope="module")
def coordinator(objects) -> dict:
    return objects["Deployment", "gradstar-coordinator"]


@pytest.fixture(scope="module")
def shards(objects) -> dict:
    return objects["StatefulSet", "gradstar-shard"]


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, str]:
    """The container's plain ``value`` variables (``valueFrom`` ones are left out)."""
    return {e["name"]: e["value"] for e in container.get("env", ()) if "value" in e}


def _port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def _service_port(service: dict, name: str) -> dict:
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == name]
    return port


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("doc", [pytest.param(doc, id=f"{name}:{doc['kind']}")
                                 for name, doc in _documents() + _documents(DEPLOY / "ha")])
def test_every_manifest_is_valid_for_the_pinned_kubernetes_versions(doc, version):
    assert version in {major_minor(v) for v in all_versions()}, (
        f"kubernetes-validate {kubernetes_validate.__version__} ships no {version} schemas")
    # Returns the version whose schema it used: exactly the pinned one, not an older fallback.
    assert kubernetes_validate.validate(doc, version, strict=True) == version


def test_strict_validation_rejects_what_the_api_server_would(coordinator):
    # What makes the test above worth something: a misspelt field and a wrongly typed value.
    misspelt = copy.deepcopy(coordinator)
    _container(misspelt)["readinessProbe"]["grcp"] = _container(misspelt)["readinessProbe"].pop(
        "grpc")
    with pytest.raises(kubernetes_validate.ValidationError, match="grcp"):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[0], strict=True)
    mistyped = copy.deepcopy(coordinator)
    _container(mistyped)["readinessProbe"]["grpc"]["port"] = "29400"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(mistyped, KUBERNETES_VERSIONS[0], strict=True)


def test_the_objects_of_one_hub(objects, coordinator):
    assert sorted(objects) == [
        ("Deployment", "gradstar-coordinator"),
        ("PersistentVolumeClaim", "gradstar-coordinator-state"),
        ("Service", "gradstar-coordinator"),
        ("Service", "gradstar-shard"),
        ("StatefulSet", "gradstar-shard"),
    ]
    assert "namespace" not in str([o["metadata"] for o in objects.values()])  # kubectl -n
    # One coordinator, never two at once (a second one would be a second hub).
    assert coordinator["spec"]["replicas"] == 1
    assert coordinator["spec"]["strategy"] == {"type": "Recreate"}
    volumes = {v["name"]: v for v in coordinator["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in _container(coordinator)["volumeMounts"]
                if m["mountPath"] == _env(_container(coordinator))["GRADSTAR_STATE_DIR"]]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objects


def test_services_select_their_own_pods_and_name_real_ports(objects, coordinator, shards):
    for service, workload in ((objects["Service", "gradstar-coordinator"], coordinator),
                              (objects["Service", "gradstar-shard"], shards)):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = service["spec"]["selector"]
        assert selector.items() <= labels.items()
        assert workload["spec"]["selector"]["matchLabels"] == selector
        other = shards if workload is coordinator else coordinator
        assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()
        names = {p["name"] for p in _container(workload)["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (service["metadata"]["name"], port)


def test_the_coordinator_service_carries_grpc_and_metrics_also_before_it_is_ready(
        objects, coordinator):
    service = objects["Service", "gradstar-coordinator"]
    container, env = _container(coordinator), _env(_container(coordinator))
    assert _service_port(service, "grpc")["port"] == 29400
    assert _port(container, "grpc") == int(env["GRADSTAR_PORT"]) == 29400
    # Collectives' tensors have a port of their own: a free one unless fixed, so fixed here.
    assert _service_port(service, "collectives")["port"] == 29401
    assert _port(container, "collectives") == int(env["GRADSTAR_COLLECTIVE_PORT"]) == 29401
    assert _service_port(service, "metrics")["port"] == 9400
    assert _port(container, "metrics") == int(env["GRADSTAR_METRICS_PORT"]) == 9400
    assert env["GRADSTAR_METRICS_HOST"] == "0.0.0.0"  # not the default loopback
    assert env["GRADSTAR_HOST"] == "0.0.0.0"
    # The coordinator turns ready only once the shards registered through this Service.
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_each_shard_has_a_stable_dns_name(objects, shards):
    service = objects["Service", "gradstar-shard"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one A record per pod
    assert shards["spec"]["serviceName"] == service["metadata"]["name"]
    # A shard is striped over as soon as it registers, before its readiness probe passed.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert _service_port(service, "grpc")["port"] == _port(_container(shards), "grpc")
    assert shards["spec"]["podManagementPolicy"] == "Parallel"


def test_probes_ask_the_grpc_health_service_on_the_grpc_port(coordinator, shards):
    hub, shard = _container(coordinator), _container(shards)
    hub_port, shard_port = _port(hub, "grpc"), _port(shard, "grpc")
    # Ready: the coordinator's named services turn SERVING once the expected shards are up
    # ("" answers SERVING from the start); a shard's Collective once the coordinator took it.
    assert hub["readinessProbe"]["grpc"]["port"] == hub_port
    assert hub["readinessProbe"]["grpc"]["service"] in SERVICE_NAMES
    assert shard["readinessProbe"]["grpc"] == {"port": shard_port, "service": COLLECTIVE_SERVICE}
    assert shard["livenessProbe"]["grpc"] == {"port": shard_port}
    # The coordinator's liveness must not follow its health service, which is NOT_SERVING while
    # a shard is missing: restarting the coordinator then would only fail every job.
    assert "grpc" not in hub["livenessProbe"]
    assert hub["livenessProbe"]["tcpSocket"] == {"port": hub_port}


def _secret_volumes(workload: dict) -> dict[str, str]:
    """mount path -> Secret name, for the container's Secret volumes."""
    spec = workload["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    return {m["mountPath"]: secrets[m["name"]] for m in _container(workload)["volumeMounts"]
            if m["name"] in secrets}


def _readme_secret() -> tuple[str, set[str]]:
    """The Secret that deploy/kubernetes/README.md tells to create: name and keys."""
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    (name,) = re.findall(r"create secret generic (\S+)", text)
    return name, set(re.findall(r"--from-literal=([\w-]+)=", text))


def test_tokens_come_from_the_secret_as_files(coordinator, shards):
    secret, keys = _readme_secret()
    assert keys == set(SECRET_KEYS.values())
    for workload in (coordinator, shards):
        container = _container(workload)
        names = {e["name"] for e in container["env"]}
        # Never a token in the manifest, nor in a variable `kubectl describe pod` would show.
        assert not names & {"GRADSTAR_TOKEN", "GRADSTAR_ADMIN_TOKEN"}
        assert "token" not in str(container.get("args", "")) + str(container["command"])
        env, mounts = _env(container), _secret_volumes(workload)
        for variable, key in SECRET_KEYS.items():  # both: a shard registers with the admin one
            path = Path(env[variable])
            assert path.name == key
            assert mounts[str(path.parent)] == secret
        # The image runs as uid 1000; the token files are group-readable by the pod's fsGroup.
        pod = workload["spec"]["template"]["spec"]
        uid = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text())[1]
        assert pod["securityContext"]["runAsUser"] == int(uid)
        assert pod["securityContext"]["fsGroup"] == int(uid)
        (mode,) = {v["secret"]["defaultMode"] for v in pod["volumes"] if "secret" in v}
        assert mode & 0o040 and not mode & 0o007


def test_the_coordinator_expects_as_many_shards_as_the_statefulset_runs(coordinator, shards):
    env = _env(_container(coordinator))
    settings = CoordinatorSettings(shards=env["GRADSTAR_SHARDS"],
                                   expected_shards=env["GRADSTAR_EXPECTED_SHARDS"],
                                   shard_wait=env["GRADSTAR_SHARD_WAIT"])
    assert settings.expected_shards == shards["spec"]["replicas"] >= 1
    assert settings.shards == 0  # the shards are the StatefulSet's pods, none in this one
    # At start it waits for them: longer than the kubelet's first few restart back-offs
    # (10, 20, 40, 80 s) of a shard that came up before it.
    assert settings.shard_wait >= 150


def test_every_variable_is_one_a_gradstar_command_reads(coordinator, shards):
    def fields(settings_class) -> set[str]:
        return {f"GRADSTAR_{name.upper()}" for name in settings_class.model_fields}

    file_variables = set(SECRET_KEYS)  # read by the gradstar command itself (gradstar.cli)
    hub = {e["name"] for e in _container(coordinator)["env"]}
    assert hub <= fields(CoordinatorSettings) | file_variables, hub - fields(CoordinatorSettings)
    shard = {e["name"] for e in _container(shards)["env"]} - {"POD_NAME", "POD_NAMESPACE"}
    assert shard <= fields(ShardSettings) | file_variables, shard - fields(ShardSettings)
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
                for e in _container(shards)["env"] if "valueFrom" in e}
    assert downward == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}


def _shard_argv(shards: dict, tmp_path: Path, pod: str, namespace: str) -> list[str]:
    """Run the shard container's command with /bin/sh as the kubelet would, with a stand-in
    ``gradstar`` that prints the arguments it got."""
    stub = tmp_path / "gradstar"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    stub.chmod(0o755)
    command = _container(shards)["command"]
    assert command[:2] == ["/bin/sh", "-c"], command
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "POD_NAME": pod, "POD_NAMESPACE": namespace}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30,
                          check=True)
    return done.stdout.splitlines()


def test_the_shard_command_registers_with_the_coordinator_service(
        objects, coordinator, shards, tmp_path):
    argv = _shard_argv(shards, tmp_path, "gradstar-shard-3", "ml")
    assert argv[0] == "shard"
    flags = {flag: value for flag, value in itertools.pairwise(argv) if flag.startswith("--")}
    hub_service = objects["Service", "gradstar-coordinator"]
    host, _, port = flags["--coordinator"].rpartition(":")
    assert host.split(".")[0] == hub_service["metadata"]["name"]
    assert host in (hub_service["metadata"]["name"],
                    f"{hub_service['metadata']['name']}.ml.svc.cluster.local")
    assert int(port) == _service_port(hub_service, "grpc")["port"]
    # Ranks reach this pod by its own DNS name under the headless Service, at the shard port.
    assert flags["--advertise-host"] == "gradstar-shard-3.gradstar-shard.ml.svc.cluster.local"
    assert flags["--advertise-host"].split(".")[1] == shards["spec"]["serviceName"]
    assert flags["--host"] == "0.0.0.0"
    assert int(flags["--port"]) == _port(_container(shards), "grpc")
    assert flags["--slot"] == "3"  # the pod ordinal: a restarted shard takes its slot back
    assert _shard_argv(shards, tmp_path, "gradstar-shard-0", "ml")[-1] == "0"
    # Every flag is one `gradstar shard` takes, with a value its settings accept.
    help_text = subprocess.run([*GRADSTAR, "shard", "--help"], capture_output=True, text=True,
                               timeout=60, check=True, env=clean_env()).stdout
    for flag in flags:
        assert re.search(rf"{re.escape(flag)}\b", help_text), flag
    ShardSettings(**{f[2:].replace("-", "_"): v for f, v in flags.items()})


def test_both_run_the_compose_image_with_a_core_per_shard(coordinator, shards):
    image = load_compose()["services"]["coordinator"]["image"]
    for workload in (coordinator, shards):
        container = _container(workload)
        assert container["image"] == image
        assert container["imagePullPolicy"] == "IfNotPresent"
        assert "cpu" not in container["resources"].get("limits", {})  # no CFS throttling
        assert container["resources"]["limits"]["memory"]
    assert _container(coordinator)["command"] == ["gradstar", "coordinator"]
    assert _container(shards)["resources"]["requests"]["cpu"] in ("1", 1, "1000m")
    assert shlex.split(_container(shards)["command"][2])[:3] == ["exec", "gradstar", "shard"]


def test_the_ha_coordinators_elect_a_leader_that_the_ranks_reach_by_name():
    """deploy/kubernetes/ha/: two coordinators under --ha, etcd, and the Services the ranks
    use; every variable one the coordinator reads, every name one that resolves."""
    objects = {(d["kind"], d["metadata"]["name"]): d for _, d in _documents(DEPLOY / "ha")}
    assert sorted(objects) == [
        ("NetworkPolicy", "gradstar-etcd"), ("Service", "gradstar-coordinator-ha"),
        ("Service", "gradstar-etcd"), ("Service", "gradstar-leader"),
        ("StatefulSet", "gradstar-coordinator-ha"), ("StatefulSet", "gradstar-etcd")]
    hubs = objects["StatefulSet", "gradstar-coordinator-ha"]
    assert hubs["spec"]["replicas"] == 2 and hubs["spec"]["podManagementPolicy"] == "Parallel"
    container = _container(hubs)
    env = _env(container)
    fields = {f"GRADSTAR_{name.upper()}" for name in CoordinatorSettings.model_fields}
    names = {e["name"] for e in container["env"]} - {"POD_NAME", "POD_NAMESPACE"}
    assert names <= fields | set(SECRET_KEYS), names - fields
    settings = CoordinatorSettings(ha=env["GRADSTAR_HA"], ha_ttl=env["GRADSTAR_HA_TTL"])
    # The election's etcd is the Service in front of the etcd pod, on its client port.
    (endpoint,) = settings.ha.split("//")[1].split("/")[0].split(",")
    host, port = endpoint.split(":")
    etcd = objects["Service", host]
    assert int(port) in {p["port"] for p in etcd["spec"]["ports"]}
    # Each pod publishes its own name under the headless Service, which it is governed by.
    headless = objects["Service", hubs["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    advertised = env["GRADSTAR_HA_ADVERTISE"]
    assert advertised == (f"$(POD_NAME).{headless['metadata']['name']}.$(POD_NAMESPACE)"
                          f".svc.cluster.local:{_port(container, 'grpc')}")
    # Ready = leads (a standby is NOT_SERVING): the leader's Service has the ready pod only.
    assert container["readinessProbe"]["grpc"]["service"] in SERVICE_NAMES
    assert container["livenessProbe"]["tcpSocket"] == {"port": _port(container, "grpc")}
    # etcd takes connections from the coordinators only, on the port they use.
    (rule,) = objects["NetworkPolicy", "gradstar-etcd"]["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": labels_of(hubs)}}]
    assert rule["ports"] == [{"port": int(port)}]
    leader = objects["Service", "gradstar-leader"]
    assert leader["spec"]["publishNotReadyAddresses"] is False
    labels = hubs["spec"]["template"]["metadata"]["labels"]
    for service in (headless, leader):
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= {
            p["name"] for p in container["ports"]}


def labels_of(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]
