"""`disagg up`'s layout: which process gets which role, ports, GPUs and flags (no process starts)."""

import json

import pytest

from disagg import cli
from disagg.launch import Layout, Process, plan_layout

CPU: list[str] = []
FOUR_GPUS = ["0", "1", "2", "3"]


def layout(*argv: str, gpus: list[str] = CPU) -> Layout:
    return plan_layout(cli.build_parser()[0].parse_args(["up", *argv]), gpus)


def flag(process: Process, name: str) -> str | None:
    return process.command[process.command.index(name) + 1] if name in process.command else None


def kv_config(process: Process) -> dict:
    return json.loads(flag(process, "--kv-transfer-config"))


def test_default_is_the_quick_starts_1p1d_on_its_ports():
    plan = layout()
    assert plan.router is None and plan.url == "http://127.0.0.1:8000"
    (prefill,), (decode,) = plan.prefill, plan.front
    assert (prefill.name, flag(prefill, "--kv-role"), prefill.port) == ("prefill node", "producer", 8001)
    assert (decode.name, flag(decode, "--kv-role"), decode.port) == ("decode node", "consumer", 8000)
    assert flag(prefill, "--grpc-port") == "50051" and flag(decode, "--prefill-nodes") == "127.0.0.1:50051"
    assert kv_config(prefill)["kv_port"] == 14579 and kv_config(decode)["kv_port"] == 14580
    assert kv_config(decode)["kv_connector_extra_config"] == {"remote_prefill": "always"}
    assert sorted(plan.bound_ports()) == [8000, 8001, 14579, 14580, 50051]


def test_batching_and_async_scheduling_reach_the_nodes_that_take_them():
    """As a plan's `run it:` line gives them: --max-num-seqs and --async-scheduling to every node,
    --max-num-batched-tokens to the decode nodes, --prefill-max-num-batched-tokens to the prefill nodes'."""
    plan = layout("--num-prefill", "2", "--num-decode", "2", "--async-scheduling", "--max-num-seqs", "32",
                  "--max-num-batched-tokens", "1024", "--prefill-max-num-batched-tokens", "8192")
    nodes = plan.prefill + plan.front
    assert all(flag(node, "--max-num-seqs") == "32" and "--async-scheduling" in node.command for node in nodes)
    assert [flag(node, "--max-num-batched-tokens") for node in nodes] == ["8192", "8192", "1024", "1024"]
    assert not any(name in node.command for node in layout().processes
                   for name in ("--max-num-seqs", "--max-num-batched-tokens", "--async-scheduling"))  # serve's own


def test_2p2d_puts_the_router_in_front_and_every_decode_node_lists_every_prefill_node():
    plan = layout("--num-prefill", "2", "--num-decode", "2")
    assert plan.router is not None and plan.url == "http://127.0.0.1:8000"
    assert [p.name for p in plan.processes] == ["prefill node 1", "prefill node 2", "decode node 1", "decode node 2",
                                                "router"]
    assert [node.port for node in plan.front] == [8001, 8002] and [node.port for node in plan.prefill] == [8003, 8004]
    assert flag(plan.router, "--decode-nodes") == "127.0.0.1:8001,127.0.0.1:8002"
    assert flag(plan.router, "--port") == "8000" and flag(plan.router, "--host") == "127.0.0.1"
    assert [flag(node, "--grpc-port") for node in plan.prefill] == ["50051", "50052"]
    assert {flag(node, "--prefill-nodes") for node in plan.front} == {"127.0.0.1:50051,127.0.0.1:50052"}
    assert [kv_config(node)["kv_port"] for node in plan.prefill + plan.front] == [14579, 14580, 14581, 14582]
    ports = [port for process in plan.processes for port in process.ports]
    assert len(ports) == len(set(ports)) == 11  # 5 HTTP, 2 gRPC, 4 pipe
    assert set(plan.bound_ports()) == set(ports)
    assert "--routing" not in plan.router.command  # cache_aware, with the tokenizer the nodes name


def test_colocated_nodes_take_no_pipe_and_one_of_them_needs_no_router():
    plan = layout("--colocated", "3")
    assert plan.prefill == [] and [flag(node, "--kv-role") for node in plan.front] == ["both"] * 3
    assert all("--kv-transfer-config" not in node.command and "--prefill-nodes" not in node.command
               for node in plan.front)
    assert flag(plan.router, "--decode-nodes") == "127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003"
    one = layout("--colocated", "1")
    assert one.router is None and [node.port for node in one.front] == [8000]


def test_each_node_takes_its_own_gpus_prefill_nodes_first():
    plan = layout("--num-prefill", "1", "--num-decode", "3", gpus=FOUR_GPUS)
    assert [node.env for node in plan.prefill + plan.front] == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)]
    assert plan.router.env == {}
    tp = layout("-tp", "2", "--device", "cuda", gpus=FOUR_GPUS)
    assert [node.env["CUDA_VISIBLE_DEVICES"] for node in tp.prefill + tp.front] == ["0,1", "2,3"]
    assert all(flag(node, "--tensor-parallel-size") == "2" and flag(node, "--device") == "cuda"
               for node in tp.prefill + tp.front)
    # From the K-th GPU on, named as the launcher's CUDA_VISIBLE_DEVICES names them.
    offset = layout("--device", "cuda:1", gpus=["4", "5", "6", "7"])
    assert [node.env["CUDA_VISIBLE_DEVICES"] for node in offset.prefill + offset.front] == ["5", "6"]


def test_on_the_cpu_the_nodes_share_it():
    plan = layout("--num-prefill", "2", "--num-decode", "2", "-tp", "2", "--device", "cpu", gpus=FOUR_GPUS)
    assert all(node.env == {} and flag(node, "--device") == "cpu" for node in plan.processes if node.name != "router")
    assert all(node.env == {} and "--device" not in node.command for node in layout("--colocated", "4").front)


def test_fewer_gpus_than_nodes_are_shared_in_turn():
    """The quick start on a one-GPU host: both nodes on it; 2P2D on two GPUs: each takes one in turn."""
    assert [node.env for node in layout(gpus=["0"]).processes] == [{"CUDA_VISIBLE_DEVICES": "0"}] * 2
    plan = layout("--num-prefill", "2", "--num-decode", "2", gpus=["0", "1"])
    assert [node.env["CUDA_VISIBLE_DEVICES"] for node in plan.prefill + plan.front] == ["0", "1", "0", "1"]
    assert [node.env["CUDA_VISIBLE_DEVICES"] for node in layout("--device", "cuda:1", gpus=["0", "1"]).processes] \
        == ["1", "1"]


def test_too_few_gpus_or_a_combination_that_makes_no_layout_is_refused():
    with pytest.raises(ValueError, match="need 4 GPUs; this host has 2"):  # ranks are never shared
        layout("-tp", "2", gpus=["0", "1"])
    with pytest.raises(ValueError, match="cuda or cuda:N"):
        layout("--device", "cuda:x", gpus=["0"])
    with pytest.raises(ValueError, match="need 6 GPUs; this host has 4"):
        layout("--colocated", "3", "-tp", "2", gpus=FOUR_GPUS)
    with pytest.raises(ValueError, match="this host has 0"):
        layout("--device", "cuda")
    with pytest.raises(ValueError, match="without --num-prefill and --num-decode"):
        layout("--colocated", "2", "--num-decode", "2")
    with pytest.raises(ValueError, match="at least 1"):
        layout("--num-prefill", "0")
    with pytest.raises(ValueError, match="at least 1"):
        layout("--colocated", "0")


def test_ports_that_would_collide_are_refused():
    # The prefill nodes' gRPC ports 8002..8004 meet the nodes' HTTP ports 8001..8006.
    with pytest.raises(ValueError, match="gRPC port, --grpc-port .* would both be port 800"):
        layout("--num-prefill", "3", "--num-decode", "3", "--grpc-port", "8002")
    with pytest.raises(ValueError, match="not a port number"):
        layout("--num-decode", "2", "--kv-port", "65535")
