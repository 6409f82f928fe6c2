"""docker-compose.yml: the services, what they run, localhost-only ports, and `docker-compose config`.

The file is read with yaml, and `${VAR:-default}` is taken at its default (what an empty environment gives).
When a compose binary is installed, `config` validates the file against its schema too; it needs no engine.
"""

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import REPO

COMPOSE = REPO / "docker-compose.yml"
WORKER_DOCKERFILE = REPO / "docker" / "Dockerfile"
SERVICES = {"postgres", "prefect-server", "mlflow", "worker"}
# The settings docker/env.example lists: left out of `config`'s environment so that the defaults are checked.
SETTINGS = ("GRPO_BIND", "POSTGRES_USER", "POSTGRES_PASSWORD", "PREFECT_UI_API_URL", "MLFLOW_ALLOWED_HOSTS", "HF_TOKEN")


def at_defaults(value: str) -> str:
    """`${VAR:-default}` and `${VAR-default}` -> default, `${VAR}` -> '' (compose with VAR unset), `$$` -> `$`."""
    value = re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)
    value = re.sub(r"\$\{\w+\}", "", value)
    return value.replace("$$", "$")


def as_argv(command) -> list[str]:
    return [at_defaults(str(a)) for a in command] if isinstance(command, list) else at_defaults(command).split()


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_the_four_services(services):
    assert set(services) >= SERVICES


def test_published_ports_bind_to_localhost_by_default(services):
    published = 0
    for name, service in services.items():
        assert service.get("network_mode") != "host", f"{name}: host networking publishes every port"
        for port in service.get("ports", []):
            published += 1
            if isinstance(port, dict):
                host_ip = at_defaults(str(port.get("host_ip", "")))
            else:
                parts = at_defaults(str(port)).split(":")
                host_ip = parts[0] if len(parts) == 3 else ""
            assert host_ip == "127.0.0.1", f"{name}: port {port!r} is not bound to 127.0.0.1 by default"
    assert published >= 2  # the Prefect UI/API and the MLflow UI


def test_servers_wait_for_a_healthy_postgres(services):
    assert services["postgres"]["healthcheck"]["test"]
    for name in ("prefect-server", "mlflow"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert services[name]["healthcheck"]["test"], name
    init = [v for v in services["postgres"]["volumes"] if "docker-entrypoint-initdb.d" in v]
    assert init and all((REPO / v.split(":")[0]).is_file() for v in init)


def test_prefect_server_runs_on_postgres(services):
    prefect = services["prefect-server"]
    assert as_argv(prefect["command"])[:3] == ["prefect", "server", "start"]
    assert option(as_argv(prefect["command"]), "--host") == "0.0.0.0"
    env = {k: at_defaults(str(v)) for k, v in prefect["environment"].items()}
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"].endswith("@postgres:5432/prefect")
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"


def test_mlflow_keeps_runs_in_postgres_and_artifacts_in_a_volume(services):
    mlflow = services["mlflow"]
    argv = as_argv(mlflow["command"])
    assert argv[:2] == ["mlflow", "server"]
    assert re.match(r"postgresql(\+\w+)?://", option(argv, "--backend-store-uri"))
    assert option(argv, "--backend-store-uri").endswith("@postgres:5432/mlflow")
    assert "--serve-artifacts" in argv
    named_volumes = {v.split(":")[1]: v.split(":")[0] for v in mlflow["volumes"]}
    destination = option(argv, "--artifacts-destination")
    assert destination in named_volumes, f"{destination} is not a mounted volume"
    assert named_volumes[destination] in yaml.safe_load(COMPOSE.read_text())["volumes"]
    # the worker reaches it as http://mlflow:5000, and MLflow refuses Host headers it does not know
    assert "mlflow:*" in option(argv, "--allowed-hosts").split(",")


def test_worker_runs_the_prefect_worker_on_gpus(services):
    worker = services["worker"]
    argv = as_argv(worker["command"])
    assert argv[:5] == ["prefect", "worker", "start", "--pool", "grpo-process"]
    assert option(argv, "--type") == "process"
    env = {k: at_defaults(str(v)) for k, v in worker["environment"].items()}
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert worker["shm_size"]
    assert (REPO / worker["build"]["context"] / worker["build"]["dockerfile"]) == WORKER_DOCKERFILE


def test_worker_image_matches_compose_and_pyproject(services):
    dockerfile = WORKER_DOCKERFILE.read_text()
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd and yaml.safe_load(cmd.group(1)) == as_argv(services["worker"]["command"])
    assert 'pip install -e ".[gpu' in dockerfile
    # the worker's Prefect is the server's, and carries the FastAPI pin that pyproject gives Prefect 3.7
    server_version = services["prefect-server"]["image"].split(":")[1].split("-")[0]
    assert f"ARG PREFECT_VERSION={server_version}\n" in dockerfile
    fastapi_pin = re.search(r'"(fastapi\[standard\]==[\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert fastapi_pin and f'ARG FASTAPI="{fastapi_pin.group(1)}"' in dockerfile


def test_worker_polls_the_pool_of_the_deployments(services):
    prefect_yaml = REPO / "prefect.yaml"
    if not prefect_yaml.is_file():
        pytest.skip("prefect.yaml is not there yet")
    pools = {(d.get("work_pool") or {}).get("name") for d in yaml.safe_load(prefect_yaml.read_text())["deployments"]}
    assert option(as_argv(services["worker"]["command"]), "--pool") in pools


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def test_compose_config_validates(tmp_path):
    compose = compose_command()
    if compose is None:
        pytest.skip("no docker-compose binary and no `docker compose` plugin (Debian: apt-get install docker-compose)")
    empty_env_file = tmp_path / "empty.env"  # a developer's .env must not change the defaults checked here
    empty_env_file.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    done = subprocess.run(
        [*compose, "--env-file", str(empty_env_file), "-f", str(COMPOSE), "config"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert set(resolved) >= SERVICES
    for name, service in resolved.items():
        for port in service.get("ports", []):
            host_ip = port["host_ip"] if isinstance(port, dict) else str(port).split(":")[0]
            assert host_ip == "127.0.0.1", f"{name}: {port!r}"
