"""What the Python peers under bench/ (fsdp2/fsdp2_llama.py, qlora/qlora_peer.py) and their comparisons
(fsdp2/compare.py, qlora/compare.py) share with bench_table, one way each: the LLaMA presets, the model-FLOPs
formula and peak constant, the default learning rate, the training windows, the run's metadata, and the JSON-lines
files. Standard library at import (the comparisons run without torch); the functions that need torch import it.

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))   # from bench/<dir>/
    import bench_common
"""
import json
import os
import sys

# vocab, hidden, layers, heads, kv_heads, ffn: nn::LlamaConfig::preset (include/squeeze/nn/llama.hpp) and
# plan::find_preset (include/squeeze/plan/model_shape.hpp).
PRESETS = {
    "tiny": (256, 128, 4, 4, 2, 352),
    "125m": (32000, 768, 12, 12, 12, 2048),
    "tinyllama-1.1b": (32000, 2048, 22, 32, 4, 5632),
    "llama-7b": (32000, 4096, 32, 32, 32, 11008),
}
ROPE_THETA = 10000.0  # nn::LlamaConfig::rope_theta
NORM_EPS = 1e-5  # nn::LlamaConfig::norm_eps

# NVIDIA's H200 SXM datasheet: 1,979 TFLOP/s of bf16 tensor-core math with 2:4 sparsity, so 989 TFLOP/s dense
# (bench_table's kH200DenseBf16Flops).
H200_DENSE_BF16_FLOPS = 989e12


def flops_per_token(vocab, hidden, layers, heads, kv_heads, ffn, seq):
    """6·N + 12·L·T·d with N = every parameter but the token-embedding table (plan::ModelShape::params() -
    embedding_params(), as bench_table: the seven linears and two norm gains per block, the final norm, the head)."""
    kv_dim = kv_heads * (hidden // heads)
    block = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * ffn + 2 * hidden
    n = layers * block + hidden + vocab * hidden
    return 6.0 * n + 12.0 * layers * seq * hidden


def default_lr(preset):
    """bench_table's AdamW learning rate when --lr is not given (llama::default_lr in examples/llama/trainer.hpp)."""
    return {"125m": 1e-3, "tinyllama-1.1b": 3e-4, "llama-7b": 1e-5}.get(preset, 3e-3)


def corpus_tokens(path):
    """bench_table's training text of FILE as byte tokens: every line but the last 5% (at least one)."""
    import torch

    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if len(lines) < 2:
        raise SystemExit(f"--corpus {path}: needs at least two lines (train and validation)")
    n_val = max(1, int(len(lines) * 0.05))
    text = b"".join(line + b"\n" for line in lines[: len(lines) - n_val])
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()  # [n]


def batch(args, vocab, tokens, step, rank, world, device):
    """This rank's [B, T] inputs and targets of step `step` (args.batch = B, args.seq = T, args.seed): rows
    [rank·B, (rank+1)·B) of B·world windows of T+1 tokens drawn from a generator seeded with (seed, step), as
    bench_table splits its batches: random tokens over the vocabulary, or windows of `tokens` (corpus_tokens)."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 1000003 + step)
    n = args.batch * world
    if tokens is None:
        w = torch.randint(0, vocab, (n, args.seq + 1), generator=g)  # [B·world, T+1]
    else:
        start = torch.randint(0, tokens.numel() - args.seq - 1, (n, 1), generator=g)  # [B·world, 1]
        w = tokens[start + torch.arange(args.seq + 1)]  # [B·world, T+1]
    w = w[rank * args.batch : (rank + 1) * args.batch].to(device)
    return w[:, :-1], w[:, 1:]


def run_metadata(device_type):
    """device, date, commit of a result line: SQUEEZE_DEVICE / SQUEEZE_DATE / SQUEEZE_COMMIT, as bench_table."""
    return {"device": os.environ.get("SQUEEZE_DEVICE", device_type), "date": os.environ.get("SQUEEZE_DATE", ""),
            "commit": os.environ.get("SQUEEZE_COMMIT", "")}


def append_jsonl(path, records):
    """Appends one JSON line per record."""
    with open(path, "a") as out:
        for r in records:
            out.write(json.dumps(r) + "\n")


def read_jsonl(paths, tool):
    """Every JSON object of the files, in order; a missing file is reported on stderr (as `tool: PATH not found`)
    and skipped, blank lines too."""
    for path in paths:
        try:
            with open(path) as f:
                lines = f.readlines()
        except FileNotFoundError:
            print(f"{tool}: {path} not found", file=sys.stderr)
            continue
        for line in lines:
            line = line.strip()
            if line:
                yield json.loads(line)


def fmt(r, key, spec):
    """r[key] formatted with `spec`, or "-" when the record or the key is missing."""
    return format(r[key], spec) if r is not None and key in r else "-"


def split_jsonl_option(args):
    """(arguments without `--jsonl OUT`, OUT or None)."""
    args = list(args)
    if "--jsonl" not in args:
        return args, None
    i = args.index("--jsonl")
    if i + 1 >= len(args):
        raise SystemExit("--jsonl needs a file name")
    return args[:i] + args[i + 2:], args[i + 1]
