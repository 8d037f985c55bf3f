"""deploy/: the compose files agree with the real CLI and with themselves, and their services,
run as local processes with the exact same arguments, answer a request through the router.

No container runtime is needed: service names are mapped to 127.0.0.1 and every port to a free
one (containers each have their own ports; local processes share the host's), nothing else changes.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from servers import free_port

from disagg import cli

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE_FILES = ["docker-compose.yml", "xpyd.yml"]
# Compose interpolation as these files use it: ${VAR}, ${VAR:-default}, ${VAR:?error}.
VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")
DEFAULT_GRPC_PORT = 50051  # `disagg serve --grpc-port`'s default


def env_example() -> dict[str, str]:
    values = {}
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def interpolate(value, env: dict[str, str]):
    """What `docker compose` makes of a value, given the variables in `env`."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        name, kind, word = match.groups()
        if env.get(name):
            return env[name]
        if kind == "-":
            return word
        raise AssertionError(f"${{{name}}} has no value in deploy/.env.example" + (f" ({word})" if word else ""))

    return VARIABLE.sub(substitute, value)


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def addresses(text: str) -> list[tuple[str, int]]:
    pairs = [a.rpartition(":") for a in text.split(",")]
    return [(host, int(port)) for host, _, port in pairs]


@dataclass
class Service:
    name: str
    spec: dict  # the compose service, interpolated

    @property
    def argv(self) -> list[str]:
        return self.spec["command"]

    @property
    def environment(self) -> dict[str, str]:
        return self.spec.get("environment", {})

    @property
    def role(self) -> str:
        return "router" if self.argv[1] == "router" else flag(self.argv, "--kv-role")

    @property
    def port(self) -> int:
        return int(flag(self.argv, "--port"))

    @property
    def grpc_port(self) -> int:
        return int(flag(self.argv, "--grpc-port", str(DEFAULT_GRPC_PORT)))

    @property
    def kv(self) -> dict:
        return json.loads(flag(self.argv, "--kv-transfer-config"))

    @property
    def health_url(self) -> str:
        test = self.spec["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], f"{self.name}: healthcheck must be [CMD, python, -c, ...]"
        return re.search(r"'(http://[^']+)'", test[3]).group(1)


def load(file: str) -> dict[str, Service]:
    compose = yaml.safe_load((DEPLOY / file).read_text())
    env = env_example()
    return {name: Service(name, interpolate(spec, env)) for name, spec in compose["services"].items()}


def dockerfile_exposed() -> set[int]:
    text = (DEPLOY / "Dockerfile").read_text()
    return {int(p) for line in text.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}


@pytest.mark.parametrize("file", COMPOSE_FILES)
def test_every_variable_has_a_value_in_env_example(file: str):
    text = json.dumps(yaml.safe_load((DEPLOY / file).read_text()))  # the values, not the comments
    env = env_example()
    assert "$" not in VARIABLE.sub("", text), f"{file}: write variables as ${{VAR}}"
    for name, kind, _ in VARIABLE.findall(text):
        assert env.get(name) or kind == "-", f"{file} uses ${{{name}}}, which deploy/.env.example does not set"


@pytest.mark.parametrize("file", COMPOSE_FILES)
def test_commands_are_accepted_by_the_cli(file: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    for service in load(file).values():
        for name, value in service.environment.items():  # the secrets compose hands this service
            monkeypatch.setenv(name, value)
        argv = service.argv
        assert argv[0] == "disagg", f"{service.name}: the command must start with the disagg executable"
        if service.role == "router":
            # `disagg router` has no --check-config: parse with its real parser and address check.
            from disagg.router import add_router_parser
            from disagg.router.router import parse_decode_nodes

            parser = argparse.ArgumentParser(prog="disagg")
            add_router_parser(parser.add_subparsers(dest="command"))
            parse_decode_nodes(parser.parse_args(argv[1:]).decode_nodes)
            continue
        cli.main(argv[1:] + ["--check-config"])
        assert "config ok" in capsys.readouterr().out, f"{service.name}: {argv}"
        for name in service.environment:
            monkeypatch.delenv(name)


@pytest.mark.parametrize("file", COMPOSE_FILES)
def test_services_line_up(file: str):
    services = load(file)
    by_role = {role: [s for s in services.values() if s.role == role] for role in ("producer", "consumer", "router")}
    assert by_role["producer"] and by_role["consumer"] and len(by_role["router"]) == 1, f"{file}: roles {by_role}"
    exposed = dockerfile_exposed()
    tokens, api_keys = set(), set()
    for s in services.values():
        assert s.spec["restart"] == "unless-stopped", s.name
        assert s.spec["image"] and s.spec["build"]["dockerfile"] == "deploy/Dockerfile", s.name
        assert flag(s.argv, "--host") == "0.0.0.0", f"{s.name} must listen beyond its own loopback"
        assert s.health_url == f"http://127.0.0.1:{s.port}/health", f"{s.name}: healthcheck and --port differ"
        own_ports = {s.port} | ({s.grpc_port} if s.role == "producer" else set()) | (
            {s.kv["kv_port"]} if s.role == "consumer" else set())
        assert own_ports <= exposed, f"{s.name}: the Dockerfile does not EXPOSE {own_ports - exposed}"
        # Secrets come from the environment, each service holding only the ones it uses: never argv.
        assert "--api-key" not in s.argv, f"{s.name}: the API key belongs in the environment"
        assert set(s.environment) == {"producer": {"DISAGG_KV_AUTH_TOKEN"}, "router": {"DISAGG_API_KEY"},
                                      "consumer": {"DISAGG_KV_AUTH_TOKEN", "DISAGG_API_KEY"}}[s.role], s.name
        if s.role != "router":
            assert s.kv["kv_ip"] == s.name, f"{s.name}: kv_ip must be the address peers reach it at, its own name"
            assert "kv_connector_extra_config" not in s.kv, f"{s.name}: the auth token belongs in the environment"
            tokens.add(s.environment["DISAGG_KV_AUTH_TOKEN"])
        if s.role != "producer":
            api_keys.add(s.environment["DISAGG_API_KEY"])
        if s.role in ("producer", "consumer"):
            assert {str(p) for p in own_ports} <= set(s.spec["expose"]), f"{s.name}: expose its ports"
        if s.role == "consumer":
            for host, port in addresses(flag(s.argv, "--prefill-nodes")):
                peer = depended_on(services, s, host, "producer")
                assert port == peer.grpc_port, f"{s.name} calls {host} on {port}; its --grpc-port is {peer.grpc_port}"
        if s.role == "router":
            assert s.spec["ports"] == [f"{env_example()['DISAGG_HTTP_PORT']}:{s.port}"], s.name
            for host, port in addresses(flag(s.argv, "--decode-nodes")):
                peer = depended_on(services, s, host, "consumer")
                assert port == peer.port, f"{s.name} routes to {host}:{port}; its --port is {peer.port}"
    assert len(tokens) == 1, f"{file}: the nodes must share one auth token, got {tokens}"
    assert len(api_keys) == 1, f"{file}: the router forwards the client's key: decode nodes need the same key"


def depended_on(services: dict[str, Service], service: Service, host: str, role: str) -> Service:
    """The service `service` addresses as `host`, which must be a `role` node it waits for."""
    assert host in services and services[host].role == role, f"{service.name} points at {host}, not a {role} service"
    assert service.spec["depends_on"][host] == {"condition": "service_healthy"}, f"{service.name} must wait for {host}"
    return services[host]


# -- the services as local processes -------------------------------------------------------------


def local_argv(service: Service, ports: dict[tuple[str, int], int]) -> list[str]:
    """The service's command with names -> 127.0.0.1 and ports -> `ports`; nothing else changed."""
    argv = list(service.argv)
    for name in ("--port", "--grpc-port"):
        if name in argv:
            i = argv.index(name) + 1
            argv[i] = str(ports[service.name, int(argv[i])])
    for name in ("--prefill-nodes", "--decode-nodes"):
        if name in argv:
            i = argv.index(name) + 1
            argv[i] = ",".join(f"127.0.0.1:{ports[peer]}" for peer in addresses(argv[i]))
    if "--kv-transfer-config" in argv:
        i = argv.index("--kv-transfer-config") + 1
        kv = json.loads(argv[i])
        kv["kv_ip"], kv["kv_port"] = "127.0.0.1", ports[service.name, kv["kv_port"]]
        argv[i] = json.dumps(kv)
    return [sys.executable, "-m", "disagg.cli"] + argv[1:]


def local_health_check(service: Service, ports: dict[tuple[str, int], int]) -> list[str]:
    code = service.spec["healthcheck"]["test"][3]
    assert f":{service.port}/" in code, f"{service.name}: its healthcheck does not probe --port {service.port}"
    return [sys.executable, "-c", code.replace(f":{service.port}/", f":{ports[service.name, service.port]}/")]


def wait_healthy(service: Service, proc: subprocess.Popen, check: list[str], log: Path, timeout: float = 120) -> None:
    """Run the service's own healthcheck until it passes, as docker would."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{service.name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if subprocess.run(check, capture_output=True, timeout=10, check=False).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{service.name} not healthy in {timeout}s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_compose_services_answer_through_the_router(tmp_path: Path):
    services = load("docker-compose.yml")
    ports = {}
    for s in services.values():
        ports[s.name, s.port] = free_port()
        if s.role == "producer":
            ports[s.name, s.grpc_port] = free_port()
        if s.role in ("producer", "consumer"):
            ports[s.name, s.kv["kv_port"]] = free_port()
    # Dependencies first, as depends_on orders them: prefill, decode, router.
    order = sorted(services.values(), key=lambda s: ["producer", "consumer", "router"].index(s.role))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    logs = {s.name: tmp_path / f"{s.name}.log" for s in order}
    try:
        for s in order:
            proc = subprocess.Popen(local_argv(s, ports), stdout=logs[s.name].open("w"), stderr=subprocess.STDOUT,
                                    env={**env, **s.environment})
            procs.append(proc)
            wait_healthy(s, proc, local_health_check(s, ports), logs[s.name])
        router = services["router"]
        url = f"http://127.0.0.1:{ports['router', router.port]}/v1/chat/completions"
        # Long enough (over local_prefill_max_tokens) that the decode node sends it to the prefill node.
        question = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 20) + ". Say hello."
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0}
        assert httpx.post(url, json=body, timeout=60).status_code == 401  # the API key is wired in
        headers = {"Authorization": f"Bearer {env_example()['DISAGG_API_KEY']}"}
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"].strip()
        # The KV came over the pipe: the prefill node computed the prompt, the decode node did not.
        assert "recomputing" not in logs["decode"].read_text(), logs["decode"].read_text()[-3000:]
        assert re.search(r"prefill \S+: \d+ prompt tokens", logs["prefill"].read_text()), logs["prefill"].read_text()
        assert "(auth on)" in logs["prefill"].read_text(), \
            "the prefill node did not take the token from its environment"
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_node_open_beyond_loopback_needs_a_token_or_insecure(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture):
    monkeypatch.delenv("DISAGG_KV_AUTH_TOKEN", raising=False)
    prefill = ["serve", "--kv-role", "producer", "--host", "0.0.0.0", "--device", "cpu", "--check-config"]
    decode = ["serve", "--kv-role", "consumer", "--prefill-nodes", "127.0.0.1:50051", "--device", "cpu",
              "--check-config", "--kv-transfer-config", '{"kv_ip": "10.0.0.5"}']
    for argv in (prefill, decode):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert "--insecure" in capsys.readouterr().err
        cli.main(argv + ["--insecure"])
        assert "config ok" in capsys.readouterr().out
    cli.main(["serve", "--kv-role", "producer", "--device", "cpu", "--check-config"])  # loopback: no token needed
    assert "config ok" in capsys.readouterr().out


def test_grpc_and_the_pipe_use_different_keys_derived_from_the_secret():
    from disagg.config import KVTransferConfig

    secret = "s3cret-of-16-bytes+"

    def config(role: str, token: str | None) -> KVTransferConfig:
        return KVTransferConfig(kv_role=role, kv_connector_extra_config={"auth_token": token} if token else None)

    grpc_key = config("producer", secret).grpc_token()
    pipe_key = config("producer", secret).pipe_config().auth_token
    assert len({grpc_key, pipe_key, secret}) == 3  # what gRPC metadata shows opens no pipe
    assert (config("consumer", secret).grpc_token(), config("consumer", secret).pipe_config().auth_token) == \
        (grpc_key, pipe_key)
    assert config("consumer", "another-16-byte-secret").grpc_token() != grpc_key
    assert config("producer", None).grpc_token() is None and config("producer", None).pipe_config().auth_token is None


def test_the_auth_token_comes_from_the_environment_unless_the_config_gives_one(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(cli.KV_AUTH_TOKEN_ENV, "from-the-environment")
    kv = cli.transfer_config(argparse.Namespace(kv_transfer_config=None, kv_role="producer"))
    assert kv.extra("auth_token") == "from-the-environment"
    given = '{"kv_connector_extra_config": {"auth_token": "given-in-the-config"}}'
    given_config = cli.transfer_config(argparse.Namespace(kv_transfer_config=given, kv_role=None))
    assert given_config.extra("auth_token") == "given-in-the-config"
