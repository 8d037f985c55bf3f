"""A vLLM user's `vllm serve` command line, given to `disagg serve --check-config` in a real process
(which loads no model): every flag is accepted and mapped, or refused with one line naming it; the seed
documents' command lines start unchanged; Hugging Face Hub ids resolve from an offline cache; vLLM's
connector names map onto our pipes and tiers; and the command line loads no torch until it must."""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.api.protocol import ChatCompletionRequest, CompletionRequest, ServerSamplingOptions
from disagg.engine.sampling_params import SamplingParamError
from disagg.vllm_connectors import KVTiers, translate

REPO = Path(__file__).resolve().parents[1]
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"  # the commit every prepared repository is at
# The Hub ids the command lines below name; each is the embedded model's files in a prepared cache.
HUB_IDS = ["Qwen/Qwen2.5-1.5B-Instruct", "NousResearch/Meta-Llama-3-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
           "meta-llama/Meta-Llama-3.1-8B-Instruct", "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B-Instruct",
           "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3-8b", "meta-llama/Llama-2-7b-hf",
           "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"]


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A Hugging Face Hub cache (models--ORG--NAME/snapshots/<commit>/..., refs/main) holding the
    embedded model under each id, as `hf download` leaves it (its files are links, as there)."""
    cache = tmp_path_factory.mktemp("hf-hub")
    for repo in HUB_IDS:
        root = cache / f"models--{repo.replace('/', '--')}"
        (root / "snapshots" / SNAPSHOT).mkdir(parents=True)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(SNAPSHOT)
        for f in model_dir.iterdir():
            (root / "snapshots" / SNAPSHOT / f.name).symlink_to(f)
    return cache


def disagg(args: list[str], hf_cache: Path, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    for name in [n for n in environment if n.startswith(("DISAGG_", "LMCACHE_")) and n not in env]:
        del environment[name]
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], capture_output=True, text=True, timeout=120,
                          env=environment, cwd=cwd)


def check_config(command: str, hf_cache: Path, **env: str) -> subprocess.CompletedProcess:
    """A `vllm serve ...` line, run as `disagg serve ... --check-config`."""
    argv = command.split(" ", 2)[2] if command.startswith("vllm serve ") else command
    return disagg(["serve", *shlex.split(argv), "--check-config"], hf_cache, **env)


def assert_refused_in_one_line(result: subprocess.CompletedProcess, text: str) -> None:
    errors = [line for line in result.stderr.splitlines() if line.startswith("disagg: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "usage:" not in result.stderr and "unrecognized arguments" not in result.stderr, result.stderr
    assert text in errors[0], errors[0]


# (where it comes from, the command line, None if it starts, else a piece of its one-line refusal).
# The Hub ids are the documents' own; the prepared cache holds the embedded model under each.
VLLM_COMMAND_LINES = [
    ("vLLM docs, getting_started/quickstart.md",
     "vllm serve Qwen/Qwen2.5-1.5B-Instruct", None),
    ("vLLM docs, serving/openai_compatible_server.md",
     "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123", None),
    ("vLLM docs, serving/openai_compatible_server.md (the note on default sampling parameters)",
     "vllm serve Qwen/Qwen2.5-1.5B-Instruct --generation-config vllm", None),
    ("vLLM docs, features/tool_calling.md (Qwen models: the hermes parser)",
     "vllm serve Qwen/Qwen2.5-7B-Instruct --enable-auto-tool-choice --tool-call-parser hermes", None),
    ("vLLM docs, features/tool_calling.md (Llama 3.1)",
     "vllm serve meta-llama/Llama-3.1-8B-Instruct --enable-auto-tool-choice --tool-call-parser llama3_json", None),
    ("vLLM docs, features/reasoning_outputs.md",
     "vllm serve deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --reasoning-parser deepseek_r1", None),
    ("vLLM docs, features/tool_calling.md (a parser not built here)",
     "vllm serve meta-llama/Llama-3.1-8B-Instruct --enable-auto-tool-choice --tool-call-parser llama4_pythonic",
     "--tool-call-parser llama4_pythonic: the parsers built are hermes, llama3_json, mistral, pythonic, qwen3_coder"),
    ("vLLM examples/online_serving/disaggregated_prefill.sh, the prefill node",
     "vllm serve meta-llama/Meta-Llama-3.1-8B-Instruct --port 8100 --max-model-len 100 --gpu-memory-utilization 0.8 "
     "--trust-remote-code --kv-transfer-config "
     "'{\"kv_connector\":\"PyNcclConnector\",\"kv_role\":\"kv_producer\",\"kv_rank\":0,\"kv_parallel_size\":2}'", None),
    ("vLLM examples/online_serving/disaggregated_prefill.sh, the decode node",
     "vllm serve meta-llama/Meta-Llama-3.1-8B-Instruct --port 8200 --max-model-len 100 --gpu-memory-utilization 0.8 "
     "--trust-remote-code --kv-transfer-config "
     "'{\"kv_connector\":\"PyNcclConnector\",\"kv_role\":\"kv_consumer\",\"kv_rank\":1,\"kv_parallel_size\":2}'", None),
    ("vLLM docs, design/p2p_nccl_connector.md (a prefill node of the xPyD example; its model directory as a Hub id)",
     "vllm serve meta-llama/Llama-3.1-8B-Instruct --host 0.0.0.0 --port 20001 --tensor-parallel-size 1 --seed 1024 "
     "--served-model-name base_model --dtype float16 --max-model-len 10000 --max-num-batched-tokens 10000 "
     "--max-num-seqs 256 --trust-remote-code --gpu-memory-utilization 0.9 --disable-log-request --kv-transfer-config "
     "'{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_producer\",\"kv_buffer_size\":\"1e1\",\"kv_port\":"
     "\"21001\",\"kv_connector_extra_config\":{\"proxy_ip\":\"127.0.0.13\",\"proxy_port\":\"30001\",\"http_port\":"
     "\"20001\"}}'",
     "serves other nodes on gRPC 0.0.0.0:50051 with no kv_connector_extra_config.auth_token"),
    ("vLLM docs, features/nixl_connector_usage.md",
     "vllm serve Qwen/Qwen3-0.6B --port 8100 --enforce-eager "
     "--kv-transfer-config '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'", None),
    ("LMCache docs, getting started: CPU offloading with vLLM v1",
     "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 16384 "
     "--kv-transfer-config '{\"kv_connector\":\"LMCacheConnectorV1\", \"kv_role\":\"kv_both\"}'", None),
    ("moyiii-ai/vllm srs_test/lmcache_vllm0.sh (GitHub)",
     "vllm serve meta-llama/Llama-3.1-8B --gpu-memory-utilization 0.8 --no-enable-prefix-caching --port 8000 "
     "--kv-transfer-config '{\"kv_connector\":\"LMCacheConnectorV1\", \"kv_role\":\"kv_both\"}'",
     "--kv-offloading-size needs the prefix cache"),
    ("vLLM blog, 'Inside vLLM's New KV Offloading Connector' (vLLM 0.11's connector config)",
     "vllm serve Qwen/Qwen3-0.6B --kv-transfer-config '{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":"
     "\"kv_both\",\"kv_connector_extra_config\":{\"num_cpu_blocks\":1000}}'",
     "num_cpu_blocks is not taken here: give kv_connector_extra_config.cpu_bytes_to_use"),
    ("vLLM docs, features/disagg_prefill.md (MultiConnector: a pipe and the CPU offloading connector)",
     "vllm serve Qwen/Qwen3-0.6B --kv-transfer-config '{\"kv_connector\":\"MultiConnector\",\"kv_role\":\"kv_both\","
     "\"kv_connector_extra_config\":{\"connectors\":[{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"},"
     "{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":"
     "{\"cpu_bytes_to_use\":1073741824}}]}}'", None),
    ("ggaaooppeenngg/cpumemconnector run_d.sh (GitHub): a connector of its own",
     "vllm serve Qwen/Qwen3-0.6B --port 8200 --max-model-len 2048 --gpu-memory-utilization 0.8 --trust-remote-code "
     "--kv-transfer-config '{\"kv_connector\":\"SharedCPUMemoryConnector\",\"kv_rank\":1,\"kv_parallel_size\":2,"
     "\"kv_role\":\"kv_consumer\",\"kv_connector_module_path\":\"cpu_memory_connector\"}'",
     "kv_connector 'SharedCPUMemoryConnector' is not a known pipe"),
    ("vLLM docs, serving/distributed_serving.md (its model is not in the prepared cache: one that is)",
     "vllm serve meta-llama/Llama-3.1-8B --tensor-parallel-size 2", None),
    ("vLLM docs, serving/distributed_serving.md",
     "vllm serve gpt2 --tensor-parallel-size 1 --pipeline-parallel-size 2",
     "--pipeline-parallel-size 2: pipeline parallelism is not built"),
    ("ggaaooppeenngg/vllm run_d.sh (GitHub): vLLM takes --flag_name for --flag-name",
     "vllm serve meta-llama/Llama-3.1-8B --port 8200 --max-model-len 4096 --tensor_parallel_size=4", None),
    ("vLLM docs, configuration/engine_args.md (tensor parallelism with a host KV tier, not built together)",
     "vllm serve meta-llama/Llama-3.1-8B --tensor-parallel-size 2 --swap-space 4",
     "--kv-offloading-size with --tensor-parallel-size > 1: KV tiers under tensor parallelism are not built yet"),
    ("the same, with a size no node can have",
     "vllm serve meta-llama/Llama-3.1-8B --port 8200 --tensor_parallel_size=0",
     "--tensor-parallel-size must be at least 1, got 0"),
    ("vLLM docs, serving/data_parallel_deployment.md",
     "vllm serve Qwen/Qwen2.5-1.5B-Instruct --data-parallel-size 4", "disagg router --decode-nodes"),
    ("vLLM docs, features/quantization/auto_awq.md",
     "vllm serve TheBloke/Llama-2-7b-Chat-AWQ --quantization awq",
     "--quantization awq: quantized weights are not built"),
    ("vLLM docs, features/quantization/quantized_kvcache.md (as flags)",
     "vllm serve Qwen/Qwen2.5-1.5B-Instruct --kv-cache-dtype fp8", "--kv-cache-dtype fp8: the KV cache is kept"),
    ("vLLM docs, features/spec_decode.md",
     "vllm serve facebook/opt-6.7b --speculative_config '{\"model\": \"facebook/opt-125m\", "
     "\"num_speculative_tokens\": 5}'", "speculative decoding is not built"),
    ("vLLM docs, features/lora.md",
     "vllm serve meta-llama/Llama-2-7b-hf --enable-lora --lora-modules sql-lora=jashing/tinyllama-colorist-lora",
     "--enable-lora: LoRA adapters are not built"),
    ("vLLM docs, configuration/engine_args.md (server and engine flags together)",
     "vllm serve Qwen/Qwen2.5-1.5B-Instruct --served-model-name qwen --swap-space 4 --disable-log-stats "
     "--uvicorn-log-level warning --max-logprobs 5 --enable-chunked-prefill --enable-prefix-caching --seed 0 "
     "--max-num-seqs 16 --block-size 16 --load-format safetensors --distributed-executor-backend mp "
     "--tokenizer-mode auto --max-seq-len-to-capture 8192 --disable-uvicorn-access-log", None),
    ("vLLM docs, configuration/engine_args.md: --generation-config with a directory that does not exist",
     "vllm serve Qwen/Qwen2.5-1.5B-Instruct --generation-config /no/such/dir",
     "--generation-config '/no/such/dir' is none of auto, vllm or a directory"),
]


@pytest.mark.parametrize("source, command, refusal", VLLM_COMMAND_LINES,
                         ids=[f"{i}-{line[1].split()[2]}" for i, line in enumerate(VLLM_COMMAND_LINES)])
def test_vllm_command_line_starts_or_is_refused_in_one_line(source: str, command: str, refusal: str | None,
                                                            hf_cache: Path):
    result = check_config(command, hf_cache)
    if refusal is None:
        assert result.returncode == 0 and result.stdout.startswith("config ok"), result.stderr
        assert f"snapshots/{SNAPSHOT}" in result.stdout  # the Hub id came from the cache
    else:
        assert_refused_in_one_line(result, refusal)


def test_vllm_flags_are_mapped(hf_cache: Path):
    result = check_config("vllm serve Qwen/Qwen2.5-1.5B-Instruct --swap-space 4 --kv-cache-memory-bytes 100000000",
                          hf_cache)
    assert "host KV tier 4 GiB eager" in result.stdout, result.stderr
    result = check_config("--model Qwen/Qwen3-0.6B --gpu-memory-utilization 0.9", hf_cache)
    assert "models--Qwen--Qwen3-0.6B" in result.stdout
    assert "--gpu-memory-utilization is for GPUs and is ignored on the CPU" in result.stderr
    assert_refused_in_one_line(check_config("--gpu-memory-utilization 0.9 --kv-cache-memory 1GiB", hf_cache),
                               "give --kv-cache-memory or --gpu-memory-utilization, not both")
    assert_refused_in_one_line(check_config("--gpu-memory-utilization 1.5", hf_cache), "in (0, 1]")
    assert_refused_in_one_line(check_config("--swap-space 2 --kv-offloading-size 3", hf_cache),
                               "--swap-space 2.0 and --kv-offloading-size 3.0 both size the host KV tier")
    assert_refused_in_one_line(check_config("--max-logprobs 50", hf_cache), "--max-logprobs 50")
    assert_refused_in_one_line(check_config("--served-model-name a b", hf_cache), "one name is served")
    assert_refused_in_one_line(check_config("--no-enable-chunked-prefill", hf_cache), "always prefills in chunks")
    assert_refused_in_one_line(check_config("--ssl-keyfile k.pem", hf_cache), "TLS is not built")
    assert_refused_in_one_line(check_config("--kv-role consumer --kv-transfer-config "
                                            "'{\"kv_connector\": \"PyNcclConnector\", \"kv_role\": \"kv_producer\"}'",
                                            hf_cache), "--kv-role consumer disagrees with kv_role")
    assert_refused_in_one_line(check_config("--profiler-config '{\"profiler\": \"cuda\", "
                                            "\"torch_profiler_dir\": \"t\"}'", hf_cache),
                               "profiler 'cuda' is not built here")


def test_seed_documents_command_lines_start_unchanged(hf_cache: Path, tmp_path: Path):
    # seeds/000: vLLM's SimpleCPUOffloadConnector, 3 GiB of host memory, eager offload.
    result = check_config("vllm serve meta-llama/Llama-3-8b --enable-prefix-caching "
                          "--kv-connector SimpleCPUOffloadConnector "
                          "--kv-connector-extra-config '{\"cpu_bytes_to_use_per_rank\": 3221225472, "
                          "\"lazy_offload\": false}'", hf_cache)
    assert "config ok: role both" in result.stdout and "host KV tier 3 GiB eager" in result.stdout, result.stderr
    # seeds/001 points at vLLM's disaggregated_prefill example (PyNcclConnector, kv_producer and kv_consumer,
    # kv_rank 0 and 1): its two nodes' configs, as in the online example above.
    for role, rank in (("kv_producer", 0), ("kv_consumer", 1)):
        config = json.dumps({"kv_connector": "PyNcclConnector", "kv_role": role, "kv_rank": rank,
                             "kv_parallel_size": 2})
        result = check_config(f"vllm serve meta-llama/Llama-3-8b --kv-transfer-config '{config}'", hf_cache)
        assert f"config ok: role {role.removeprefix('kv_')}, pipe torch_dist" in result.stdout, result.stderr
    # seeds/002: LMCache, by the command line alone and with the seed's lmcache_config.yaml.
    result = check_config("vllm serve meta-llama/Llama-2-7b-hf --kv-transfer-config "
                          "'{\"kv_connector\": \"LMCacheConnector\",\"kv_buffer_size\": 1e9}'", hf_cache)
    assert "host KV tier 5 GiB eager" in result.stdout, result.stderr  # LMCache's default local CPU size
    (tmp_path / "lmcache_config.yaml").write_text(
        'chunk_size: 256\nlocal_device: "cpu"\nmax_local_cache_size: 10  # GB\nremote_url: "redis://localhost:6379"\n'
        'remote_serde: "torch"\nenable_p2p: true\np2p_host: "localhost"\np2p_init_ports: [8200, 8202]\n'
        'transfer_channel: "nixl"\n')
    result = check_config("vllm serve meta-llama/Llama-2-7b-hf --kv-transfer-config '{\"kv_connector\": "
                          "\"LMCacheConnector\"}'", hf_cache, LMCACHE_CONFIG_FILE=str(tmp_path / "lmcache_config.yaml"))
    assert "host KV tier 10 GiB eager" in result.stdout, result.stderr
    assert "remote_url" in result.stderr  # named as ignored
    result = check_config("vllm serve meta-llama/Llama-2-7b-hf --kv-transfer-config '{\"kv_connector\": "
                          "\"LMCacheConnectorV1\"}'", hf_cache, LMCACHE_LOCAL_DISK=f"file://{tmp_path}/disk",
                          LMCACHE_MAX_LOCAL_DISK_SIZE="20", LMCACHE_MAX_LOCAL_CPU_SIZE="2")
    assert f"host KV tier 2 GiB eager, disk KV tier {tmp_path}/disk 20 GiB" in result.stdout, result.stderr


def test_hub_id_resolves_from_the_offline_cache(hf_cache: Path, tmp_path: Path):
    result = disagg(["serve", "meta-llama/Llama-3-8b", "--revision", SNAPSHOT, "--check-config"], hf_cache)
    assert result.stdout.strip().endswith(f"models--meta-llama--Llama-3-8b/snapshots/{SNAPSHOT}"), result.stderr
    # What a node runs on start (the download path): the snapshot, with no network.
    code = "from disagg.engine.loader import resolve_model; print(resolve_model('Qwen/Qwen3-0.6B'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"})
    assert result.stdout.strip() == str(hf_cache / "models--Qwen--Qwen3-0.6B" / "snapshots" / SNAPSHOT), result.stderr
    # --download-dir is the cache to look in.
    result = disagg(["serve", "Qwen/Qwen3-0.6B", "--download-dir", str(hf_cache), "--check-config"], tmp_path)
    assert "models--Qwen--Qwen3-0.6B" in result.stdout, result.stderr


def test_hub_id_offline_and_not_cached_is_one_line(hf_cache: Path):
    result = disagg(["serve", "mistralai/Mistral-7B-Instruct-v0.3", "--check-config"], hf_cache)
    assert_refused_in_one_line(result, "model 'mistralai/Mistral-7B-Instruct-v0.3' is not in the Hugging Face cache")
    assert "$HF_HUB_OFFLINE is set" in result.stderr
    result = disagg(["generate", "mistralai/Mistral-7B-Instruct-v0.3"], hf_cache)
    assert_refused_in_one_line(result, "is not in the Hugging Face cache")
    result = disagg(["serve", "meta-llama/Llama-3-8b", "--revision", "v2", "--check-config"], hf_cache)
    assert_refused_in_one_line(result, "at revision 'v2' is not in the Hugging Face cache")


def test_no_flag_may_be_abbreviated(hf_cache: Path):
    result = disagg(["serve", "--kv-rol", "producer", "--check-config"], hf_cache)
    assert result.returncode == 2 and "unrecognized arguments: --kv-rol" in result.stderr
    result = disagg(["router", "--decode-node", "127.0.0.1:8100"], hf_cache)
    assert result.returncode == 2 and "required: --decode-nodes" in result.stderr  # --decode-node was not taken for it
    for entry in ("https://127.0.0.1:8100", "127.0.0.1:8100/v1"):  # http://HOST:PORT is taken (test_router's cluster)
        result = disagg(["router", "--decode-nodes", entry], hf_cache)
        assert result.returncode == 2 and f"entry {entry!r} is not HOST:PORT or http://HOST:PORT" in result.stderr


def test_the_command_line_and_the_router_load_no_torch():
    code = ("import sys, disagg.cli, disagg.router.server; from disagg.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'numpy', 'fastapi') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "['fastapi']", result.stderr  # the router serves with fastapi, never torch
    result = subprocess.run([sys.executable, "-c", "import sys, disagg.cli; print('fastapi' in sys.modules)"],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_help_is_on_every_flag_and_log_requests_help_agrees_with_itself():
    from disagg.cli import all_parsers, build_parser

    parser, serve = build_parser()
    for sub in all_parsers(parser)[1:]:
        for action in [a for a in sub._actions if not isinstance(a, argparse._SubParsersAction)]:
            assert action.help, f"{sub.prog} {action.option_strings or action.dest} has no help"
    text = " ".join(serve.format_help().split())
    enable = re.search(r"--enable-log-requests (.*?) --disable-log-requests", text).group(1)
    disable = re.search(r"--disable-log-requests, --disable-log-request (.*?) --", text).group(1)
    assert "off by default" in enable and "the default" in disable, (enable, disable)
    assert "(default: True)" not in enable


def test_readme_table_of_vllm_flags_is_the_parser_s():
    """README's table is printed by `python -m disagg.vllm_flags`; regenerate it when this fails."""
    result = subprocess.run([sys.executable, "-m", "disagg.vllm_flags"], capture_output=True, text=True, timeout=60)
    table = result.stdout
    assert table.startswith("| vLLM flag |") and table.count("\n") > 50, result.stderr
    readme = (REPO / "README.md").read_text()
    assert table in readme, "README's table of vLLM flags differs from `python -m disagg.vllm_flags`"


def test_generation_config_defaults_and_max_logprobs():
    from disagg.engine.loader import generation_defaults

    options = ServerSamplingOptions({"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}, max_logprobs=2)
    params = CompletionRequest(prompt="x", max_tokens=None).to_sampling_params(100, options)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.9, 7)
    params = CompletionRequest(prompt="x", temperature=0, max_tokens=20).to_sampling_params(100, options)
    assert (params.temperature, params.top_p, params.max_tokens) == (0, 0.9, 20)  # what the request sets wins
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert chat.to_sampling_params(5, options).max_tokens == 5  # less context left than the config's 7
    with pytest.raises(SamplingParamError, match="more than the 2 this server allows"):
        CompletionRequest(prompt="x", logprobs=3).to_sampling_params(100, options)
    assert generation_defaults(None, {"temperature": 0.7, "max_new_tokens": 50, "do_sample": True}) == {
        "temperature": 0.7, "max_tokens": 50}


def test_vllm_connector_names_map_onto_pipes_and_tiers(monkeypatch: pytest.MonkeyPatch):
    fields, tiers = translate({"kv_connector": "P2pNcclConnector", "kv_role": "kv_consumer", "kv_buffer_size": "8e9",
                               "kv_connector_extra_config": {"proxy_ip": "127.0.0.13", "auth_token": "t"}})
    assert fields == {"kv_connector": "torch_dist", "kv_role": "kv_consumer",
                      "kv_connector_extra_config": {"auth_token": "t"}} and not tiers.asks()
    fields, tiers = translate({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
    assert fields["kv_connector"] == "nixl"
    fields, tiers = translate({"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
                               "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "NixlConnector"}, {"kv_connector": "SimpleCPUOffloadConnector",
                                                          "kv_connector_extra_config": {"cpu_bytes_to_use": 2**31,
                                                                                        "lazy_offload": True}}]}})
    assert fields["kv_connector"] == "nixl" and (tiers.kv_offloading_size, tiers.kv_offloading_mode) == (2.0, "lazy")
    with pytest.raises(ValueError, match="names two pipes"):
        translate({"kv_connector": "MultiConnector", "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "NixlConnector"}, {"kv_connector": "PyNcclConnector"}]}})
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    _, tiers = translate({"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {
        "lmcache.max_local_cpu_size": 1.5, "lmcache.local_disk": "file:///tmp/kv", "max_local_disk_size": 8}})
    assert (tiers.kv_offloading_size, tiers.kv_disk_path, tiers.kv_disk_size) == (1.5, "/tmp/kv", 8.0)
    assert translate({"kv_connector": "tcp", "kv_port": 1}) == ({"kv_connector": "tcp", "kv_port": 1}, KVTiers())


def test_gpu_memory_utilization_sizes_the_kv_cache_as_vllm(monkeypatch: pytest.MonkeyPatch):
    """The fraction of the GPU's total memory for the whole process: the KV cache gets what the model and
    a step leave; a GPU with less free memory than asked is refused at start (no GPU needed here)."""
    import torch

    from disagg.engine import builder
    from disagg.engine.config import EngineConfig
    from disagg.engine.models.llama import LlamaConfig

    gib = 2**30
    mc = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=128,
                     tie_word_embeddings=True)
    config = EngineConfig(gpu_memory_utilization=0.5, max_num_batched_tokens=16, max_num_seqs=2)
    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    assert builder.gpu_free_at_start(config, device) == 60 * gib
    activations = builder.step_activation_bytes(config, mc, torch.bfloat16)
    budget = builder.gpu_kv_cache_budget(config, mc, device, torch.bfloat16, free_at_start=70 * gib)
    assert budget == 40 * gib - 10 * gib - activations  # half of 80 GiB, less the 10 GiB the model took
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    with pytest.raises(ValueError, match="is less than --gpu-memory-utilization 0.5 asks for"):
        builder.gpu_free_at_start(config, device)


def test_the_prefill_graphs_count_in_a_steps_memory_and_their_bound_is_checked():
    """The prefill graphs' memory pool holds a step of their largest size and every bucket's final hidden
    states beside the eager step's activations: counted unless they are off (eager, sdpa, 0); a bound that
    is not a count of tokens is refused before anything is built."""
    import dataclasses

    import torch

    from disagg.engine import builder
    from disagg.engine.config import EngineConfig
    from disagg.engine.models.llama import LlamaConfig

    mc = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    config = EngineConfig(max_num_batched_tokens=2048, max_num_seqs=2)

    def step_bytes(**changes) -> int:
        return builder.step_activation_bytes(dataclasses.replace(config, **changes), mc, torch.bfloat16)

    off = step_bytes(max_prefill_graph_tokens=0)
    assert step_bytes(enforce_eager=True) == step_bytes(attention_backend="sdpa") == off
    assert off < step_bytes(max_prefill_graph_tokens=512) < step_bytes() < step_bytes(max_prefill_graph_tokens=2048)
    assert step_bytes(max_prefill_graph_tokens=4096) == step_bytes(max_prefill_graph_tokens=2048)  # a step's most
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="max_prefill_graph_tokens must be a number of tokens"):
            builder.prefill_graph_tokens(dataclasses.replace(config, max_prefill_graph_tokens=bad))
