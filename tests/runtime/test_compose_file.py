"""docker-compose.yml and the Dockerfile, read as data: services, health checks, dependencies
and environment wiring agree with each other and with what the gradstar commands read.

(`make compose-check` additionally validates the file with docker-compose itself.)
"""

from __future__ import annotations

import itertools
import re

import pytest

from gradstar.config import ClientSettings, CoordinatorSettings, ShardSettings
from gradstar.coordinator.shards import LocalShards
from gradstar.worker.demo.train import TrainSettings
from gradstar.worker.host.agent import AgentSettings

from .compose import ROOT, env_file, healthcheck_argv, load_compose, local_argv, service_env
from .conftest import run_gradstar


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def test_three_services_from_one_image_and_the_shard_is_opt_in(compose):
    services = compose["services"]
    assert sorted(services) == ["coordinator", "shard", "worker"]
    assert {s["image"] for s in services.values()} == {services["coordinator"]["image"]}
    assert {s["build"] for s in services.values()} == {"."}
    # A plain `docker compose up` runs what it always ran; the shard needs --profile shards.
    assert services["shard"]["profiles"] == ["shards"]
    assert "profiles" not in services["coordinator"] and "profiles" not in services["worker"]


def test_workers_wait_for_a_healthy_coordinator_they_reach_by_service_name(compose):
    coordinator, worker = compose["services"]["coordinator"], compose["services"]["worker"]
    assert worker["depends_on"] == {"coordinator": {"condition": "service_healthy"}}
    port = service_env(coordinator)["GRADSTAR_PORT"]
    assert service_env(worker)["GRADSTAR_COORDINATOR"] == f"coordinator:{port}"
    assert service_env(coordinator)["GRADSTAR_HOST"] == "0.0.0.0"
    assert f"{port}:{port}" in coordinator["ports"]
    # Collectives' tensors: a port of their own, fixed and published for ranks on the host.
    collectives = service_env(coordinator)["GRADSTAR_COLLECTIVE_PORT"]
    assert collectives != port
    assert f"{collectives}:{collectives}" in coordinator["ports"]


def test_the_published_metrics_port_reaches_the_metrics_endpoint(compose):
    # `curl localhost:9400/metrics` (docs/compose.md) goes through the published port: the endpoint
    # must not bind the container's loopback, its default.
    env = service_env(compose["services"]["coordinator"])
    port = env["GRADSTAR_METRICS_PORT"]
    assert f"{port}:{port}" in compose["services"]["coordinator"]["ports"]
    assert env["GRADSTAR_METRICS_HOST"] == "0.0.0.0"


def test_the_coordinator_healthcheck_asks_the_grpc_health_service_on_its_port(compose):
    coordinator = compose["services"]["coordinator"]
    argv = healthcheck_argv(coordinator)
    assert argv[:3] == ["gradstar", "admin", "health"]
    port = service_env(coordinator)["GRADSTAR_PORT"]
    assert argv[argv.index("--coordinator") + 1] == f"127.0.0.1:{port}"
    for key in ("interval", "timeout", "retries", "start_period"):
        assert key in coordinator["healthcheck"]


async def test_the_coordinator_healthcheck_command_follows_serving_and_draining(
        start_coordinator, compose):
    # The same command, against a live coordinator: SERVING passes, draining fails.
    hub = await start_coordinator()
    argv = healthcheck_argv(compose["services"]["coordinator"])
    argv[argv.index("--coordinator") + 1] = hub.address
    code, out, _ = await run_gradstar(*local_argv(argv)[3:], timeout=30)
    assert (code, out.strip()) == (0, "SERVING")
    await hub.drain()
    code, out, _ = await run_gradstar(*local_argv(argv)[3:], timeout=30)
    assert (code, out.strip()) == (1, "NOT_SERVING")


def _flags(command: list[str]) -> dict[str, str]:
    """``--some-flag VALUE`` pairs of a command, as settings field names."""
    return {flag[2:].replace("-", "_"): value
            for flag, value in itertools.pairwise(command) if flag.startswith("--")}


def test_the_shard_service_is_a_remote_style_shard_the_workers_reach_by_name(
        compose, monkeypatch):
    coordinator, shard = compose["services"]["coordinator"], compose["services"]["shard"]
    command = shard["command"]
    assert command[:2] == ["gradstar", "shard"]
    for key, value in service_env(shard).items():
        monkeypatch.setenv(key, value)
    settings = ShardSettings(**_flags(command))  # what `gradstar shard` makes of it
    assert settings.advertise_host == "shard"  # the service name: compose DNS, for the ranks
    assert settings.slot == 0  # a restarted shard takes its old slot back
    assert settings.coordinator == f"coordinator:{service_env(coordinator)['GRADSTAR_PORT']}"
    assert settings.host == "0.0.0.0" and settings.port > 0  # reachable, at a known port
    argv = healthcheck_argv(shard)
    assert argv[:3] == ["gradstar", "admin", "health"]
    assert argv[argv.index("--coordinator") + 1] == f"127.0.0.1:{settings.port}"
    # It must not wait for a healthy coordinator: the coordinator is healthy only once the
    # expected shards registered, so that would never start.
    assert shard["depends_on"] == {"coordinator": {"condition": "service_started"}}
    # It exits non-zero when it loses the coordinator: something has to start it again.
    assert shard["restart"] in ("always", "unless-stopped") or shard["restart"].startswith(
        "on-failure")


def test_the_coordinator_expects_the_shard_services_that_run():
    def expected(compose: dict, profiles: set[str]) -> tuple[int, int]:
        services = compose["services"]
        running = [s for s in services.values()
                   if not set(s.get("profiles", ())) or set(s["profiles"]) & profiles]
        shards = sum(s["command"][:2] == ["gradstar", "shard"] for s in running)
        env = service_env(services["coordinator"])
        return int(CoordinatorSettings(expected_shards=env["GRADSTAR_EXPECTED_SHARDS"])
                   .expected_shards), shards

    # .env.example as it is: no shard service runs, and the coordinator waits for none.
    assert "GRADSTAR_EXPECTED_SHARDS" not in env_file()
    wanted, running = expected(load_compose(), set())
    assert wanted == running == 0
    # What .env.example says to set for `docker compose --profile shards up`.
    assert "# GRADSTAR_EXPECTED_SHARDS=1" in (ROOT / ".env.example").read_text(encoding="utf-8")
    wanted, running = expected(load_compose(GRADSTAR_EXPECTED_SHARDS="1"), {"shards"})
    assert wanted == running == 1


def test_no_shard_starts_where_the_workers_cannot_reach_it(compose):
    env = service_env(compose["services"]["coordinator"])
    shards = CoordinatorSettings(shards=env["GRADSTAR_SHARDS"]).shards  # a number, not "auto"
    # Shards that `--shards K` starts in the coordinator's container bind this host; the
    # workers run in other containers.
    command = LocalShards(CoordinatorSettings(host="0.0.0.0"), 29400, 1)._command(0)
    if command[command.index("--host") + 1] in ("127.0.0.1", "localhost", "::1"):
        assert shards == 0


def test_the_worker_is_scalable_and_runs_the_demo_job_under_the_agent(compose):
    worker = compose["services"]["worker"]
    assert "ports" not in worker, "fixed host ports would collide between the replicas"
    assert "container_name" not in worker
    command = worker["command"]
    assert command[:2] == ["gradstar", "worker"]
    assert command[command.index("--") + 1:] == ["python", "-m", "gradstar.worker.demo.train"]
    env = service_env(worker)
    assert env["GRADSTAR_WORLD_SIZE"] == env_file()["GRADSTAR_WORKERS"]
    assert str(worker["deploy"]["replicas"]) == env_file()["GRADSTAR_WORKERS"]
    assert env["GRADSTAR_NPROC"] == "1"  # one rank per container: containers = world size
    assert int(env["GRADSTAR_MAX_RESTARTS"]) > 0
    assert TrainSettings(mode=env["GRADSTAR_TRAIN_MODE"]).mode == "localsgd"
    health = " ".join(healthcheck_argv(worker))
    assert f"http://127.0.0.1:{env['GRADSTAR_HEALTH_PORT']}/healthz" in health


def test_one_variable_sets_both_the_worker_containers_and_the_world_size():
    raw = (ROOT / "docker-compose.yml").read_text(encoding="utf-8")
    assert raw.count("${GRADSTAR_WORKERS:-4}") == 2  # replicas and world size, one default
    for count in ("1", "7"):
        worker = load_compose(GRADSTAR_WORKERS=count)["services"]["worker"]
        assert worker["deploy"]["replicas"] == count  # what `docker compose up` starts
        assert service_env(worker)["GRADSTAR_WORLD_SIZE"] == count
    # Nothing tells the user to keep a --scale in step by hand any more.
    for text in (raw, (ROOT / ".env.example").read_text(encoding="utf-8")):
        assert "do not use --scale" in text or "Do not pass --scale" in text
        assert "up --build --scale" not in text


def _fields(settings_class, prefix: str) -> set[str]:
    return {prefix + name.upper() for name in settings_class.model_fields}


def test_every_variable_is_one_a_gradstar_command_reads(compose):
    # A misspelt variable would be silently ignored by pydantic-settings: catch it here.
    coordinator_keys = set(service_env(compose["services"]["coordinator"]))
    assert coordinator_keys <= _fields(CoordinatorSettings, "GRADSTAR_")
    worker_keys = set(service_env(compose["services"]["worker"]))
    known = (_fields(AgentSettings, "GRADSTAR_") | _fields(ClientSettings, "GRADSTAR_")
             | _fields(TrainSettings, "GRADSTAR_TRAIN_"))
    assert worker_keys <= known, worker_keys - known
    shard_keys = set(service_env(compose["services"]["shard"]))
    assert shard_keys <= _fields(ShardSettings, "GRADSTAR_"), shard_keys


def test_tokens_come_from_the_env_file_and_only_the_hub_holds_the_admin_token():
    raw = (ROOT / "docker-compose.yml").read_text(encoding="utf-8")
    assert raw.count("${GRADSTAR_TOKEN:?") == 3  # every service, no default token
    # The coordinator, and the shard that registers with it; never a worker.
    assert raw.count("${GRADSTAR_ADMIN_TOKEN:?") == 2
    compose = load_compose()
    assert "GRADSTAR_ADMIN_TOKEN" not in service_env(compose["services"]["worker"])
    for hub in ("coordinator", "shard"):
        env = service_env(compose["services"][hub])
        assert env["GRADSTAR_ADMIN_TOKEN"] == env_file()["GRADSTAR_ADMIN_TOKEN"], hub
    with pytest.raises(KeyError, match="GRADSTAR_TOKEN"):
        load_compose(GRADSTAR_TOKEN="")
    assert {"GRADSTAR_TOKEN", "GRADSTAR_ADMIN_TOKEN"} <= set(env_file())


def test_the_dockerfile_builds_the_image_every_service_runs():
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r'pip install .*"torch==2\.13\.0"', dockerfile)
    assert re.search(r"^ARG TORCH=cpu$", dockerfile, re.M)
    assert re.search(r"^EXPOSE .*\b29400\b.*\b29401\b.*\b9400\b.*\b8080\b", dockerfile,
                     re.M)
    assert re.search(r'^CMD \["gradstar", "coordinator"\]', dockerfile, re.M)
    for folder in ("src", "coordinator", "client", "worker", "protos"):
        assert re.search(rf"^COPY {folder} ", dockerfile, re.M), folder
    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    assert ".env" in ignored and ".venv" in ignored
