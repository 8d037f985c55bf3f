"""GPU end to end: disagg 1P1D over torch_dist (NCCL, cuda:0 -> cuda:1) vs colocated on one GPU.

    python benchmarks/gpu_e2e.py --tokenizer-dir DIR --shapes 1b,8b --json gpu_e2e.json

Models are Llama configs of the 1B (Llama-3.2-1B) and 8B (Llama-3-8B) shapes with random
bfloat16 weights (seeded), written with the embedded model's tokenizer (tokenizer.json from
--tokenizer-dir): outputs are noise, but every request runs its full length (ignore_eos), which is
all the timing needs. The vocabulary is the tokenizer's 49152, not Llama 3's 128256: ids past the
tokenizer's vocabulary decode to no text, and a stream without text has no first token to time
(so the embedding and lm_head are 2.6x smaller than the real models').

Per shape: the colocated node (GPU 0), and the pair (prefill node on GPU 0, decode node on GPU 1,
each seeing only its GPU through CUDA_VISIBLE_DEVICES; KV buffer on the GPU so the pipe uses
NCCL) are up together. (1) A QPS sweep with `disagg bench serve`'s load generator, rates side by
side, alternating order; (2) the KV handoff split of kv_handoff.py for 128..2048-token prompts.
--gpus 1 puts both disagg nodes on GPU 0 (NCCL within one GPU is refused, so the pipe becomes tcp
with the KV buffer on the host).
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import NodeSpec, save_metrics, sweep, systems, table, warm_up
from kv_handoff import measure
from kv_handoff import table as handoff_table

SHAPES = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 64, "intermediate_size": 8192, "vocab_size": 49152, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "intermediate_size": 14336, "vocab_size": 49152, "tie_word_embeddings": False},
    # Narrow and deep: on a CPU its KV is large beside its compute, as an 8B model's is beside an
    # H200's across hosts, so moving it takes a share of the prefill's time (handoff_h200x2.py --device cpu).
    "narrow": {"hidden_size": 256, "num_hidden_layers": 16, "num_attention_heads": 4, "num_key_value_heads": 4,
               "head_dim": 64, "intermediate_size": 512, "vocab_size": 49152, "tie_word_embeddings": True},
    # A seconds-to-build shape for trying the script on a CPU.
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 49152, "tie_word_embeddings": True},
}


def write_model(shape: str, out: Path, tokenizer_dir: Path, device: str) -> Path:
    import torch
    from safetensors.torch import save_file

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **s, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    gen = torch.Generator(device=device).manual_seed(0)
    h, q = s["hidden_size"], s["num_attention_heads"] * s["head_dim"]
    kv, ff, vocab = s["num_key_value_heads"] * s["head_dim"], s["intermediate_size"], s["vocab_size"]

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": ones(h)}
    if not s["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(vocab, h)
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                        p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                        p + "mlp.gate_proj.weight": rand(ff, h), p + "mlp.up_proj.weight": rand(ff, h),
                        p + "mlp.down_proj.weight": rand(h, ff), p + "input_layernorm.weight": ones(h),
                        p + "post_attention_layernorm.weight": ones(h)})
    # Written under another name and renamed: a run killed mid-write leaves no file that the next
    # run would take for the model.
    save_file(tensors, str(out / "model.safetensors.tmp"))
    (out / "model.safetensors.tmp").replace(out / "model.safetensors")
    return out


def node_specs(device: str, gpus: int) -> tuple[NodeSpec, NodeSpec, NodeSpec, str]:
    if device == "cpu":
        return NodeSpec(threads=2), NodeSpec(threads=1), NodeSpec(threads=1), "torch_dist"
    gpu0 = {"CUDA_VISIBLE_DEVICES": "0"}
    gpu1 = {"CUDA_VISIBLE_DEVICES": "1" if gpus > 1 else "0"}
    spec = {"device": "cuda", "threads": 4}
    return (NodeSpec(env=gpu0, **spec), NodeSpec(env=gpu0, **spec), NodeSpec(env=gpu1, **spec),
            "torch_dist" if gpus > 1 else "tcp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", required=True, help="a directory with tokenizer.json and tokenizer_config.json")
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the script with --shapes tiny")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--work", default="/tmp/gpu_e2e")
    ap.add_argument("--qps", default="4,16,64")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="sweep repeats")
    ap.add_argument("--lens", default="128,512,1024,2048")
    ap.add_argument("--handoff-repeats", type=int, default=5)
    ap.add_argument("--kv-cache-memory", default="16GiB")
    ap.add_argument("--kv-buffer-device", default="cuda",
                    help="cuda: the KV stays on the GPU, torch_dist sends it over NCCL; cpu: over gloo via host memory")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds: a shape starts only with 150 s left")
    ap.add_argument("--json", default=None)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    start = time.time()
    work = Path(args.work)
    log_root = Path(args.log_dir) if args.log_dir else work / "logs"
    colocated, prefill, decode, connector = node_specs(args.device, args.gpus)
    extra = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "4096"]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    report = {"args": vars(args), "connector": connector, "shapes": {}}
    for shape in args.shapes.split(","):
        if shape != args.shapes.split(",")[0] and time.time() - start > args.budget - 150:
            print(f"skipping {shape}: {time.time() - start:.0f}s of the {args.budget:.0f}s budget used", flush=True)
            report["shapes"][shape] = "skipped: time budget"
            continue
        t0 = time.time()
        model = write_model(shape, work / f"llama-{shape}", Path(args.tokenizer_dir),
                            "cuda" if args.device == "cuda" else "cpu")
        print(f"[{shape}] model written in {time.time() - t0:.0f}s", flush=True)
        vocab = SHAPES[shape]["vocab_size"]
        with systems(log_root / shape, colocated, prefill, decode, model=str(model), dtype=dtype,
                     connector=connector, extra=extra,
                     kv_buffer_device=args.kv_buffer_device if args.device == "cuda" else None) as sys_by_name:
            print(f"[{shape}] nodes up at {time.time() - start:.0f}s", flush=True)
            for system in sys_by_name.values():
                warm_up(system, vocab)
            handoff = measure(sys_by_name, [int(n) for n in args.lens.split(",")], args.handoff_repeats, vocab)
            print(f"[{shape}] KV handoff (medians of {args.handoff_repeats})\n{handoff_table(handoff)}", flush=True)
            rates = [r.strip() for r in args.qps.split(",")]
            results = sweep(sys_by_name, rates, args.repeats, num_requests=args.num_requests,
                            input_len=args.input_len, output_len=args.output_len, prompt_kind="token-ids",
                            vocab_size=vocab)
            print(f"[{shape}] QPS sweep, input {args.input_len} / output {args.output_len}, "
                  f"{args.num_requests} requests a rate\n{table(results)}", flush=True)
            recomputed = sys_by_name["disagg"].front.log().count("recomputing it here")
            save_metrics(sys_by_name, log_root / shape)
        report["shapes"][shape] = {"handoff": handoff, "sweep": results, "recomputed": recomputed,
                                   "seconds": time.time() - t0}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"[{shape}] done in {time.time() - t0:.0f}s (decode node recomputed {recomputed})", flush=True)
    print(f"total {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
