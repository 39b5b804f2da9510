"""The docker-compose topology without docker: the coordinator service and two worker services
run their compose commands and environment as separate processes, each in its own network
namespace on a shared bridge (loopback where namespaces are not allowed), the workers reaching
the coordinator by the address the compose file gives (``coordinator:29400``). The workers
start once the coordinator's health check passes, as ``depends_on: service_healthy`` does, and
the demo job must train to completion."""

from __future__ import annotations

import asyncio
import json
import re
import secrets

from .compose import healthcheck_argv, load_compose, local_argv, service_env
from .conftest import Lines, clean_env, stop_process
from .netns import service_network

WORKERS = 2
# Small enough for the test suite; everything else is the compose file's.
FAST = {"GRADSTAR_TRAIN_EPOCHS": "2", "GRADSTAR_TRAIN_SAMPLES": "2400"}


async def _run(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        await stop_process(proc)
    return proc.returncode, out.decode()


async def _wait_healthy(network, argv: list[str], env: dict[str, str], timeout: float) -> None:
    """Run the service's health check until it passes, like compose's service_healthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        code, out = await _run(network.argv("coordinator", argv), env, 30)
        if code == 0:
            return
        assert loop.time() < deadline, f"the coordinator never became healthy: {out}"
        await asyncio.sleep(0.5)


async def test_compose_services_train_the_demo_job(tmp_path, capsys):
    # Real tokens, as a user's .env has: the coordinator refuses .env.example's placeholders.
    compose = load_compose(GRADSTAR_WORKERS=str(WORKERS), GRADSTAR_TOKEN=secrets.token_urlsafe(),
                           GRADSTAR_ADMIN_TOKEN=secrets.token_urlsafe())
    coordinator, worker = compose["services"]["coordinator"], compose["services"]["worker"]
    names = ["coordinator", *(f"worker-{i + 1}" for i in range(WORKERS))]
    procs: list[asyncio.subprocess.Process] = []
    with service_network(names) as network:
        with capsys.disabled():  # say which network was used, even under -q
            print(f"\ncompose topology: {network.describe()}", flush=True)
        coordinator_env = clean_env(**{**service_env(coordinator),
                                       "GRADSTAR_STATE_DIR": str(tmp_path / "state")})
        # Each container has its own pid namespace, so the hub could not map a worker's
        # shared-memory segment there; these namespaces share this host's, so say it.
        worker_env = clean_env(**{**service_env(worker), **FAST,
                                  "GRADSTAR_SHARED_MEMORY": "0"})
        health = local_argv(healthcheck_argv(coordinator))
        if network.kind == "loopback":
            # One network for everything: no fixed ports, and the service name is 127.0.0.1.
            coordinator_env.update(GRADSTAR_HOST="127.0.0.1", GRADSTAR_PORT="0",
                                   GRADSTAR_METRICS_PORT="0")
            worker_env["GRADSTAR_HEALTH_PORT"] = "0"
        try:
            procs.append(await asyncio.create_subprocess_exec(
                *network.argv("coordinator", local_argv(coordinator["command"])),
                env=coordinator_env, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL))
            hub_log = Lines(procs[0].stdout)
            port = (await hub_log.wait_for(r"listening on [\d.]+:(\d+)$", 30))[1]
            if network.kind == "loopback":
                worker_env["GRADSTAR_COORDINATOR"] = f"127.0.0.1:{port}"
                health[health.index("--coordinator") + 1] = f"127.0.0.1:{port}"
            else:
                assert worker_env["GRADSTAR_COORDINATOR"] == f"coordinator:{port}"
            await _wait_healthy(network, health, coordinator_env, 60)

            workers = [await asyncio.create_subprocess_exec(
                *network.argv(name, local_argv(worker["command"])), env=worker_env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                for name in names[1:]]
            procs += workers
            outputs = await asyncio.wait_for(
                asyncio.gather(*(p.communicate() for p in workers)), 120)
            for name, p, (out, _) in zip(names[1:], workers, outputs, strict=True):
                assert p.returncode == 0, f"{name} ({network.describe()}):\n{out.decode()[-3000:]}"
            logs = "\n".join(out.decode() for out, _ in outputs)
            assert logs.count("gradstar worker: coordinator SERVING") == WORKERS
            assert logs.count("gradstar worker: all 1 local ranks succeeded") == WORKERS
            assert re.search(r"rank 0: done, [\d,]+ samples/s", logs), logs[-3000:]

            # What `docker compose exec coordinator gradstar admin status --json` shows.
            code, out = await _run(network.argv("coordinator", local_argv(
                ["gradstar", "admin", "status", "--json", "--interval", "0", "--coordinator",
                 f"127.0.0.1:{port}"])), coordinator_env, 30)
            assert code == 0, out
            (job,) = json.loads(out)["jobs"]
            assert (job["job"], job["world_size"], job["generation"]) == ("demo", WORKERS, 1)
            assert job["collectives"]["all_reduce"]["failed"] == 0
            (model,) = job["global_models"]
            assert model["rounds"] > 0
            if network.kind == "netns":
                # Each worker container is a host of its own: its agent ran a shard there for
                # the job, registered with the job token the worker holds (the admin token is
                # the coordinator's alone).
                assert "goes on without a shard" not in logs, logs[-3000:]
                code, out = await _run(network.argv("coordinator", local_argv(
                    ["gradstar", "admin", "shards", "--json", "--coordinator",
                     f"127.0.0.1:{port}"])), coordinator_env, 30)
                assert code == 0, out
                shards = json.loads(out)["shards"]
                assert len({s["address"] for s in shards}) == WORKERS, shards
                for name in names[1:]:
                    received, sent = network.interface_bytes(name)
                    # The rank's parameters went over the bridge, not a shortcut.
                    assert sent > model["parameters"] * 4 and received > 0, (name, sent)
        finally:
            for proc in procs:
                await stop_process(proc)
