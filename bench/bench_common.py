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
    "llama-13b": (32000, 5120, 40, 40, 40, 13824),
    "llama3-8b": (128256, 4096, 32, 32, 8, 14336),
    "llama-70b": (32000, 8192, 80, 64, 8, 28672),
    "llama-175b": (32000, 12288, 96, 96, 96, 32768),
}
ROPE_THETA = 10000.0  # nn::LlamaConfig::rope_theta
NORM_EPS = 1e-5  # nn::LlamaConfig::norm_eps

# NVIDIA's H100 SXM and H200 datasheets: 1,979 TFLOP/s of bf16 tensor-core math with 2:4 sparsity, so 989 TFLOP/s
# dense on either (bench_table's kHopperDenseBf16Flops).
HOPPER_DENSE_BF16_FLOPS = 989e12


def flops_per_token(vocab, hidden, layers, heads, kv_heads, ffn, seq):
    """6·N + 12·L·T·d with N = every parameter but the token-embedding table (plan::ModelShape::params() -
    embedding_params(), as bench_table: the seven linears and two norm gains per block, the final norm, the head)."""
    kv_dim = kv_heads * (hidden // heads)
    block = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * ffn + 2 * hidden
    n = layers * block + hidden + vocab * hidden
    return 6.0 * n + 12.0 * layers * seq * hidden


def default_lr(preset):
    """bench_table's AdamW learning rate when --lr is not given (llama::default_lr in examples/llama/trainer.hpp)."""
    return {"125m": 1e-3, "tinyllama-1.1b": 3e-4, "llama-7b": 5e-6, "llama-13b": 5e-6, "llama3-8b": 5e-6, "llama-70b": 5e-6,
            "llama-175b": 5e-6}.get(preset, 3e-3)


def non_negative_int(text):
    """argparse type: an integer >= 0, else a message naming the value."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got '{text}'") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def add_run_arguments(ap, out_help, batch_help):
    """The options every peer shares with bench_table's run: --out, --preset, --layers, --batch, --seq, --steps,
    --warmup, --clip, --seed, --corpus, --device."""
    ap.add_argument("--out", required=True, help=out_help)
    ap.add_argument("--preset", default="tinyllama-1.1b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    ap.add_argument("--batch", type=int, default=8, help=batch_help)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--corpus", default="", help="byte windows of this text file instead of random tokens")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--profile-steps", type=non_negative_int, default=0,
                    help="after the timed steps, this many more under torch.profiler: the line gains \"profile\" "
                         "(bench/profile_table.py sorts its kernels by kind)")


def require_positive(args, names):
    """Exits naming the first of `names` that is not positive (and --warmup when negative)."""
    for name in names:
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name} must be positive")
    if args.warmup < 0:
        raise SystemExit("--warmup must not be negative")


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


def profile_steps(step, steps, device):
    """step(i) for i in range(steps) under torch.profiler, reduced as bench/step_profile.hpp reduces bench_table's:
    {"steps", "wall_ms" (host clock, each step synchronised), "busy_ms" (the union of the device's intervals),
    "kernels": [[name, launches, ms], ...] longest first}. On the CPU the record holds torch's operators."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
            if cuda:
                torch.cuda.synchronize(device)
        wall_ms = 1e3 * (time.perf_counter() - t0)
    want = torch._C._autograd.DeviceType.CUDA if cuda else torch._C._autograd.DeviceType.CPU
    totals, spans = {}, []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != want or e.end_ns() <= e.start_ns():
            continue
        if cuda and not device_work(e):  # e.g. an annotation spanning kernels
            continue
        t = totals.setdefault(e.name(), [0, 0.0])
        t[0] += 1
        t[1] += e.duration_ns() / 1e6
        spans.append((e.start_ns(), e.end_ns()))
    return {"steps": steps, "wall_ms": wall_ms, "busy_ms": union_ms(spans),
            "kernels": sorted(([n, c, ms] for n, (c, ms) in totals.items()), key=lambda k: -k[2])}


def device_work(event):
    """Whether a Kineto event on the device is a kernel, a copy or a memset (not an annotation spanning them). Older
    torch names each event's activity; torch 2.11's events do not, and there annotations are the only other kind."""
    activity = getattr(event, "activity_type", None)
    if activity is not None:
        return activity() in ("kernel", "gpu_memcpy", "gpu_memset")
    return not event.is_user_annotation()


def union_ms(spans):
    """Milliseconds covered by the union of [start, end) nanosecond intervals."""
    covered, open_start, open_end = 0, None, None
    for s, e in sorted(spans):
        if open_end is not None and s <= open_end:
            open_end = max(open_end, e)
            continue
        if open_end is not None:
            covered += open_end - open_start
        open_start, open_end = s, e
    if open_end is not None:
        covered += open_end - open_start
    return covered / 1e6


# Where a step's device time goes, by kernel name (lower case; the first kind whose words one appears in): the table of
# bench/profile_table.py. Anything else (norms, RoPE, SwiGLU, the loss, the optimizer, casts) is elementwise.
KERNEL_KINDS = (
    ("communication", ("nccl",)),
    ("copy", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("dequantize", ("dequant",)),
    ("gemm", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "wgmma", "cublas", "triton_tem", "scaled_mm", "splitk")),
)
KINDS = tuple(k for k, _ in KERNEL_KINDS) + ("elementwise",)


def kernel_kind(name):
    """The kind (KINDS) of a kernel named `name`."""
    low = name.lower()
    for kind, words in KERNEL_KINDS:
        if any(w in low for w in words):
            return kind
    return "elementwise"


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


def check_presets(llama_train):
    """The mismatches between this module's presets, RoPE theta, norm epsilon and default learning rates and
    what `llama_train --presets` prints (one JSON line per preset, from the C++ definitions)."""
    import subprocess

    out = subprocess.run([llama_train, "--presets"], check=True, capture_output=True, text=True).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    problems = []
    if sorted(r["preset"] for r in lines) != sorted(PRESETS):
        problems.append(f"presets: llama_train has {sorted(r['preset'] for r in lines)}, bench_common {sorted(PRESETS)}")
    for r in lines:
        name = r["preset"]
        if name not in PRESETS:
            continue
        want = tuple(r[k] for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn"))
        if PRESETS[name] != want:
            problems.append(f"{name}: geometry {PRESETS[name]} here, {want} in llama_train")
        if default_lr(name) != r["default_lr"]:
            problems.append(f"{name}: default_lr {default_lr(name)} here, {r['default_lr']} in llama_train")
        if (ROPE_THETA, NORM_EPS) != (r["rope_theta"], r["norm_eps"]):
            problems.append(f"{name}: rope_theta, norm_eps {(ROPE_THETA, NORM_EPS)} here, {(r['rope_theta'], r['norm_eps'])} in llama_train")
    return problems


if __name__ == "__main__":
    # python3 bench/bench_common.py --check-presets LLAMA_TRAIN: the Python peers' presets against the C++ ones.
    if len(sys.argv) != 3 or sys.argv[1] != "--check-presets":
        raise SystemExit("usage: bench_common.py --check-presets LLAMA_TRAIN")
    found = check_presets(sys.argv[2])
    for p in found:
        print("mismatch:", p)
    if found:
        raise SystemExit(1)
    print(f"bench_common: {len(PRESETS)} presets agree with llama_train")
