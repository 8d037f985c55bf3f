"""Issue 24's KV-plane findings, each as an attack that worked on the nodes: short or empty auth tokens,
pipe handshake slots held from several addresses, the torch_dist rendezvous store, disk-tier files a
reader could not get past, and the gRPC plane's registrations, aborts and message sizes. Loopback
only: distinct 127.0.0.x source addresses stand in for distinct hosts."""

import json
import subprocess
import sys

import pytest

from disagg import cli
from disagg.config import KVTransferConfig

GOOD_TOKEN = "0123456789abcdef"  # 16 bytes: the shortest accepted


# -- auth tokens: at least 16 bytes, an empty one refused --------------------------------------


def check_config(*argv: str) -> list[str]:
    return ["serve", "--device", "cpu", "--check-config", *argv]


@pytest.mark.parametrize("token", ["", "x", GOOD_TOKEN[:-1]])
def test_a_short_or_empty_token_is_refused_by_check_config(token, monkeypatch, capsys):
    monkeypatch.delenv("DISAGG_KV_AUTH_TOKEN", raising=False)
    config = json.dumps({"kv_connector_extra_config": {"auth_token": token}})
    for argv in (["--kv-role", "producer", "--host", "0.0.0.0"], ["--kv-role", "consumer"]):
        with pytest.raises(SystemExit):
            cli.main(check_config(*argv, "--kv-transfer-config", config))
        error = capsys.readouterr().err
        assert f"auth_token (or $DISAGG_KV_AUTH_TOKEN) is {len(token)} bytes" in error, error
        assert "secrets.token_hex(16)" in error  # how to make one
    cli.main(check_config("--kv-role", "producer", "--host", "0.0.0.0", "--kv-transfer-config",
                          json.dumps({"kv_connector_extra_config": {"auth_token": GOOD_TOKEN}})))
    assert "config ok" in capsys.readouterr().out


def test_a_short_token_from_the_environment_is_refused_before_anything_listens(monkeypatch):
    monkeypatch.setenv("DISAGG_KV_AUTH_TOKEN", "short")
    import argparse

    kv = cli.transfer_config(argparse.Namespace(kv_transfer_config=None, kv_role="producer"))
    for start in (kv.pipe_config, kv.grpc_token):  # what a node builds first
        with pytest.raises(ValueError, match="is 5 bytes; it must be at least 16"):
            start()
    with pytest.raises(ValueError, match="must be a string"):
        KVTransferConfig(kv_connector_extra_config={"auth_token": 1234567890123456789})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_disagg_serve_check_config_refuses_an_empty_token_on_every_interface():
    """The finding: `"auth_token": ""` passed --check-config on 0.0.0.0 and the node logged "auth on"."""
    result = subprocess.run([sys.executable, "-m", "disagg.cli", *check_config(
        "--kv-role", "producer", "--host", "0.0.0.0", "--kv-transfer-config",
        '{"kv_connector_extra_config": {"auth_token": ""}}')], capture_output=True, text=True, timeout=100)
    assert result.returncode != 0 and "config ok" not in result.stdout
    assert "auth_token (or $DISAGG_KV_AUTH_TOKEN) is 0 bytes; it must be at least 16" in result.stderr
