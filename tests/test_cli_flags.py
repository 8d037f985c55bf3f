"""vLLM's model and server flags through the real CLI (`disagg serve ... --check-config`, which loads
no model) and the tokenizer they configure: --tokenizer, --chat-template, --config, --shutdown-timeout,
--enable-auto-tool-choice / --tool-call-parser, and $DISAGG_<FLAG> for each."""

import json
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
from servers import start_node, wait_for

from disagg import cli
from disagg.engine.tokenizer import Tokenizer

SERVE = ["serve", "--device", "cpu", "--check-config"]
CHAT = [{"role": "user", "content": "Hi"}]


def check(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """'config ok ...', or the error it exits with."""
    try:
        cli.main(SERVE + argv)
    except SystemExit:
        return capsys.readouterr().err
    return capsys.readouterr().out


def test_tokenizer_and_chat_template_flags(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture):
    assert "config ok" in check(["--tokenizer", str(model_dir), "--chat-template", "{{ messages[0].content }}"], capsys)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    assert "config ok" in check(["--chat-template", str(tmp_path / "t.jinja"), "--trust-remote-code"], capsys)
    assert "--tokenizer" in check(["--tokenizer", str(tmp_path)], capsys)  # no tokenizer.json there
    assert "neither a file nor a jinja template" in check(["--chat-template", str(tmp_path / "none.jinja")], capsys)
    assert "does not compile" in check(["--chat-template", "{% for %}"], capsys)
    tokenizer = Tokenizer(model_dir, chat_template=(tmp_path / "t.jinja").read_text())
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=False) == "[user] Hi"


def test_chat_template_beside_the_tokenizer_and_named_templates(tmp_path: Path, model_dir: Path):
    """A tokenizer directory (--tokenizer) whose template is chat_template.jinja, as transformers now
    writes it, or a list of named templates ("tool_use" taken when tools are sent)."""
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("<{{ messages[0].content }}>")
    assert Tokenizer(model_dir, tmp_path).apply_chat_template(CHAT) == "<Hi>"
    config["chat_template"] = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(model_dir, tmp_path)
    assert tokenizer.apply_chat_template(CHAT) == "plain"
    assert tokenizer.apply_chat_template(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]) == "tools"


def test_config_file_gives_defaults_that_the_command_line_overrides(tmp_path: Path, capsys: pytest.CaptureFixture):
    config = tmp_path / "config.yaml"
    config.write_text("kv-role: consumer\nprefill_nodes: 127.0.0.1:50051\n"
                      "kv-transfer-config: {kv_connector: tcp, kv_port: '21001'}\nshutdown-timeout: 2\n")
    assert "config ok: role consumer, pipe tcp 127.0.0.1:21001" in check(["--config", str(config)], capsys)
    out = check(["--config", str(config), "--kv-role", "both", "--prefill-nodes", ""], capsys)
    assert "config ok: role both" in out
    config.write_text("enable-auto-tool-choice: true\n")
    assert "needs --tool-call-parser" in check(["--config", str(config)], capsys)
    assert "config ok" in check(["--config", str(config), "--tool-call-parser", "hermes"], capsys)
    config.write_text("tool-call-parser: bogus\n")
    assert "--tool-call-parser bogus: the parsers built are hermes" in check(["--config", str(config)], capsys)
    config.write_text("no-such-flag: 1\n")
    assert "'no-such-flag' is not a flag of disagg serve" in check(["--config", str(config)], capsys)
    assert "--shutdown-timeout must be at least 0" in check(["--shutdown-timeout", "-1"], capsys)


def test_environment_variables_give_every_flag_below_the_config_file_and_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DISAGG_KV_ROLE", "consumer")
    monkeypatch.setenv("DISAGG_PREFILL_NODES", "127.0.0.1:50051")
    monkeypatch.setenv("DISAGG_KV_TRANSFER_CONFIG", '{"kv_port": "21002"}')
    assert "config ok: role consumer, pipe tcp 127.0.0.1:21002" in check([], capsys)
    (tmp_path / "config.yaml").write_text("kv-transfer-config: {kv_port: 21003}\n")
    assert "127.0.0.1:21003" in check(["--config", str(tmp_path / "config.yaml")], capsys)
    assert "config ok: role both" in check(["--kv-role", "both", "--prefill-nodes", ""], capsys)
    monkeypatch.setenv("DISAGG_ENABLE_AUTO_TOOL_CHOICE", "true")
    assert "needs --tool-call-parser" in check([], capsys)
    monkeypatch.setenv("DISAGG_ENABLE_AUTO_TOOL_CHOICE", "maybe")
    assert "$DISAGG_ENABLE_AUTO_TOOL_CHOICE must be one of" in check([], capsys)
    monkeypatch.delenv("DISAGG_ENABLE_AUTO_TOOL_CHOICE")
    monkeypatch.setenv("DISAGG_SHUTDOWN_TIMEOUT", "soon")
    assert "--shutdown-timeout: invalid float value: 'soon'" in check([], capsys)


@pytest.mark.slow
def test_sigterm_lets_a_request_in_flight_finish_within_the_shutdown_timeout(tmp_path: Path):
    """--shutdown-timeout: on SIGTERM new connections are refused at once and a stream in flight runs
    to its end (longer than the 5 s grace there was before the flag) before the node exits."""
    node = start_node("both", tmp_path, extra_args=["--shutdown-timeout", "300"])
    body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS_DRAINED, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{node.url}/v1/completions", json=body, timeout=300) as response:
            events = (line[6:] for line in response.iter_lines() if line.startswith("data: "))
            next(events)
            node.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            wait_for(lambda: refuses_connections(node.url), 10, "the node to refuse new connections")
            rest = list(events)
        drained = time.monotonic() - signalled
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["usage"]["completion_tokens"] == MAX_TOKENS_DRAINED
        assert drained > 5, f"the stream ended {drained:.1f}s after SIGTERM: too short to tell the flag worked"
        node.proc.wait(timeout=30)
    finally:
        node.kill()


MAX_TOKENS_DRAINED = 200  # 120 once took only 4.9 s on a quiet 2-core machine: too near the old 5 s grace


def refuses_connections(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    # Refused; or, taken into the listen backlog just before the listener closed, reset or dropped unanswered.
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False


@pytest.mark.parametrize("command", [["serve"], ["router"], ["bench", "serve"]])
def test_help_gives_each_default_once(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    flags = re.split(r"\n  (?=-)", capsys.readouterr().out)
    assert len(flags) > 5
    for flag in flags:
        assert flag.count("default") <= 1, flag


def test_ctrl_c_landing_in_a_class_being_made_is_an_interrupt_not_an_error(monkeypatch, capsys):
    """A Ctrl-C while a module's pydantic models are made (importing the servers) reaches the CLI, on
    Python 3.11, as a RuntimeError from __set_name__: it is still the one-line interrupt, status 130."""
    class Interrupted:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    def serve(args):
        type("Model", (), {"field": Interrupted()})

    monkeypatch.setattr(cli, "serve", serve)
    with pytest.raises(SystemExit) as exit:
        cli.main(["serve", "--device", "cpu"])
    assert exit.value.code == 130
    assert capsys.readouterr().err == "disagg serve: interrupted\n"
