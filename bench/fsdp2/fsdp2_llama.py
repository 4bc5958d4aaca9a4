#!/usr/bin/env python3
"""The PyTorch FSDP2 peer of bench_table's ZeRO-3 rows: the same LLaMA as examples/llama
(include/squeeze/nn/llama.hpp: RMSNorm, RoPE in the rotate-half layout, grouped-query attention through
F.scaled_dot_product_attention(is_causal=True), SwiGLU, an untied head, loss in float), written in plain PyTorch
(no transformers), trained with torch.distributed.fsdp.fully_shard on every transformer block and on the root:

  parameters  fp32, sharded over the ranks (ZeRO-3); MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
              gathers them in bf16 for forward and backward and reduce-scatters the gradients in fp32
  optimizer   torch.optim.AdamW (fused when the parameters are on the GPU), the same hyper-parameters as
              bench_table (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1), gradient-norm clip --clip
  --ckpt      torch.utils.checkpoint per block (use_reentrant=False), as Checkpointed
  --offload   CPUOffloadPolicy: sharded parameters, gradients and AdamW state in pinned host memory, the
              optimizer step on the CPU, as Offload<Host>
  --compile   torchtitan's recipe: each block (wrapped for checkpointing first under --ckpt, as torchtitan's apply_ac
              does) compiled with torch.compile(fullgraph=True) before fully_shard
  --liger     Liger-Kernel's Triton kernels in the same model: LigerRMSNorm, liger_rotary_pos_emb, LigerSiLUMulFunction
              (SwiGLU) and LigerFusedLinearCrossEntropyLoss (the head + loss without the logits); with --compile too
              (then fullgraph=False: Liger's RoPE dispatch is a function torch.compile must not trace)
  --float8    torchao's float8 training, as torchtitan's float8 converter: the block linears swapped for Float8Linear
              (convert_to_float8_training, torchao's default recipe: tensorwise dynamic scaling, e4m3 forward, e5m2
              gradients) on the meta-device model, before checkpoint wrapping, compiling and fully_shard; the head (and
              any linear with a dimension not a multiple of 16) stays bf16 (module_filter_fn); FSDP2 gathers the weights
              in bf16 (enable_fsdp_float8_all_gather off, its default and torchtitan's); the peer of bench_table's fp8
              rows. With --compile it is torchtitan's float8 run; alone, eager float8 (slower: the casts unfused).
              On the CPU (smoke runs) the GEMMs are emulated (Float8LinearConfig.emulate)

Per run (one configuration per launch), written by rank 0 as one JSON line (--out, appended):
  peak_gb       torch.cuda.max_memory_allocated, reset before the model is built, read after the last timed
                step; the largest over the ranks
  time_ms       per timed step (after --warmup untimed ones), the slowest rank's
  tokens_per_s  all GPUs (world x batch x seq per step); tokens_per_s_per_gpu one GPU's
  mfu           flops_per_token x tokens_per_s_per_gpu / 989 TFLOP/s (the dense bf16 peak of an H100 SXM or an H200), with
                flops_per_token = 6·N + 12·L·T·d: N the parameters that enter a matmul (all but the token-embedding
                table; the head is untied), L layers, T = --seq, d = hidden size; the same formula and constant as
                bench_table. Recomputation (--ckpt) is not model FLOPs.
  and bench "fsdp2", case, variant (eager, or the options on, joined by +: compile, liger, float8, e.g. compile+float8),
  peer_of (the bench_table row it mirrors: zero3-bf16..., zero3-fp8... under --float8; at world 1 compare.py also pairs
  it with the unsharded row, bf16... / fp8...), world, batch (per GPU), seq, preset, final_loss, versions (torch,
  liger_kernel, torchao), float8_recipe / float8_linears (the linears converted) / float8_all_gather / float8_emulate
  under --float8, device, date, commit (env SQUEEZE_DEVICE / SQUEEZE_DATE / SQUEEZE_COMMIT, as bench_table).

Data: --batch sequences per GPU of --seq tokens; step s draws batch x world windows from a generator seeded with
(seed, s) and rank r takes rows [r·B, (r+1)·B) (as bench_table does): random tokens over the vocabulary, or
byte windows of --corpus FILE (bench_table's byte-level tokens). Throughput does not depend on which.

  python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/fsdp2/fsdp2_llama.py \\
      --preset tinyllama-1.1b --batch 8 --seq 2048 --ckpt --out fsdp2.jsonl
  python3 bench/fsdp2/fsdp2_llama.py --preset tiny --device cpu --batch 2 --seq 64 --out /tmp/f.jsonl   # world 1
Without WORLD_SIZE in the environment (plain python3) it runs as the one rank of a single-process group.
"""
import argparse
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The presets, the FLOPs formula and peak constant, the data windows: shared with bench_table's other peers.
from bench_common import (HOPPER_DENSE_BF16_FLOPS, NORM_EPS, PRESETS, ROPE_THETA, append_jsonl, batch, corpus_tokens,  # noqa: E402
                          add_run_arguments, flops_per_token, profile_steps, require_positive, run_metadata)

def liger():
    """Liger-Kernel's modules, imported only when asked for (a wheel: bench/fsdp2/README.md)."""
    import liger_kernel
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    version = getattr(liger_kernel, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version
        version = dist_version("liger-kernel")
    return {"rms_norm": LigerRMSNorm, "rope": liger_rotary_pos_emb, "silu_mul": LigerSiLUMulFunction.apply,
            "linear_ce": LigerFusedLinearCrossEntropyLoss, "version": version}


def float8():
    """torchao's float8 training API, imported only when asked for (a wheel: bench/fsdp2/README.md)."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise SystemExit(f"fsdp2_llama: --float8 needs torchao ({e}); carry its wheel (torchao-0.17.0-py3-none-any.whl, "
                         "the release for torch 2.11) in .whl/ and install it as bench/fsdp2/README.md says")
    version = getattr(torchao, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version
        version = dist_version("torchao")
    return {"config": Float8LinearConfig, "convert": convert_to_float8_training, "version": version}


def convert_float8(model, f8, emulate):
    """Swaps the block linears for Float8Linear (torchao's default recipe, tensorwise dynamic scaling); the head and
    any linear whose dimensions are not multiples of 16 (float8 GEMMs need them) stay as they are. Returns how many."""
    converted = []

    def keep_bf16(mod, fqn):  # torchao's module_filter_fn: True converts
        ok = fqn != "head" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
        if ok:
            converted.append(fqn)
        return ok

    f8["convert"](model, module_filter_fn=keep_bf16, config=f8["config"](emulate=emulate))
    return len(converted)


class RMSNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):  # [..., h]; statistics in float
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return y.to(self.weight.dtype) * self.weight


def rope_tables(T, D, device):
    """cos, sin: [T, D] in float, the D/2 frequencies twice (rotate-half layout)."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)  # [D/2]
    angles = torch.outer(torch.arange(T, dtype=torch.float32, device=device), inv_freq)  # [T, D/2]
    both = torch.cat([angles, angles], -1)  # [T, D]
    return both.cos(), both.sin()


def apply_rope(x, cos, sin):  # x: [B, H, T, D]
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def make_norm(hidden, lk):
    return lk["rms_norm"](hidden, eps=NORM_EPS, casting_mode="llama") if lk else RMSNorm(hidden)


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, lk=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.lk = heads, kv_heads, hidden // heads, lk
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):  # x: [B, T, h]
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.lk:  # Liger's RoPE takes [1, T, D] tables in the activations' dtype (as transformers hands them)
            q, k = self.lk["rope"](q, k, cos.to(q.dtype).unsqueeze(0), sin.to(q.dtype).unsqueeze(0))
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.kv_heads != self.heads
        if gqa and not (q.is_cuda and q.dtype != torch.float32):  # as llama.hpp: the fused kernels read shared K/V
            k = k.repeat_interleave(self.heads // self.kv_heads, 1)  # [B, H, T, D]
            v = v.repeat_interleave(self.heads // self.kv_heads, 1)
            gqa = False
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # [B, H, T, D]
        return self.o(a.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class Mlp(nn.Module):  # SwiGLU
    def __init__(self, hidden, ffn, lk=None):
        super().__init__()
        self.lk = lk
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        if self.lk:
            return self.down(self.lk["silu_mul"](self.gate(x), self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, hidden, heads, kv_heads, ffn, lk=None):
        super().__init__()
        self.attn_norm = make_norm(hidden, lk)
        self.attn = Attention(hidden, heads, kv_heads, lk)
        self.mlp_norm = make_norm(hidden, lk)
        self.mlp = Mlp(hidden, ffn, lk)

    def forward(self, x, cos, sin):
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, kv_heads, ffn, ckpt=False, lk=None):
        super().__init__()
        self.vocab, self.head_dim, self.layers, self.ckpt, self.lk = vocab, hidden // heads, layers, ckpt, lk
        self.wrapped = False  # the blocks checkpoint themselves (checkpoint_wrapper, under --compile)
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, ffn, lk) for _ in range(layers))
        self.norm = make_norm(hidden, lk)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.linear_ce = lk["linear_ce"]() if lk else None

    @torch.no_grad()
    def init_weights(self):
        """llama.hpp's init: N(0, 0.02), the residual projections N(0, 0.02/sqrt(2L)), norm gains 1."""
        residual_std = 0.02 / math.sqrt(2.0 * self.layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("attn.o.weight") or name.endswith("mlp.down.weight"):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, 0.02)

    def forward(self, ids, targets):  # [B, T] each -> mean next-token cross-entropy, in float (FSDP hooks forward)
        cos, sin = rope_tables(ids.size(1), self.head_dim, ids.device)
        x = self.embed(ids)  # [B, T, h]
        for block in self.blocks:
            manual = self.ckpt and self.training and not self.wrapped
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if manual else block(x, cos, sin)
        if self.linear_ce is not None:  # the head + loss in chunks, no [B, T, V] logits
            h = self.norm(x)
            return self.linear_ce(self.head.weight, h.reshape(-1, h.size(-1)), targets.reshape(-1))
        logits = self.head(self.norm(x))  # [B, T, V]
        return F.cross_entropy(logits.reshape(-1, self.vocab).float(), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(ap, out_help="append the JSON line here (rank 0)", batch_help="sequences per GPU per step")
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--offload", action="store_true", help="CPUOffloadPolicy: parameters, gradients and AdamW on the host")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block before fully_shard (torchtitan's recipe)")
    ap.add_argument("--liger", action="store_true", help="Liger-Kernel's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy")
    ap.add_argument("--deferred-loss", action="store_true",
                    help="the timed steps' batches made before the clock and their losses read after it, as bench_table --deferred-loss")
    ap.add_argument("--float8", action="store_true",
                    help="torchao float8 training of the block linears (tensorwise dynamic scaling), before compile and fully_shard")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--comm-timeout", type=float, default=600, help="seconds a collective may wait for the other ranks")
    args = ap.parse_args()
    require_positive(args, ("batch", "seq", "steps"))

    # The process group: torchrun's environment, or a single-process group (fully_shard needs one).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("fsdp2_llama: no CUDA device; pass --device cpu for a smoke run")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # CPUOffloadPolicy keeps parameters and gradients on the host, so collectives on CPU tensors need gloo beside NCCL.
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=args.comm_timeout)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    vocab, hidden, layers, heads, kv_heads, ffn = PRESETS[args.preset]
    if args.layers > 0:
        layers = args.layers
    tokens = corpus_tokens(args.corpus) if args.corpus else None
    model_flops = flops_per_token(vocab, hidden, layers, heads, kv_heads, ffn, args.seq)
    lk = liger() if args.liger else None
    f8 = float8() if args.float8 else None
    variant = "+".join(v for v, on in (("compile", args.compile), ("liger", args.liger), ("float8", args.float8)) if on) or "eager"
    row = ("offload-" if args.offload else "") + ("fp8" if args.float8 else "bf16") + ("-ckpt" if args.ckpt else "")
    case = "fsdp2-" + row + ("-" + variant.replace("+", "-") if variant != "eager" else "")
    peer_of = "zero3-" + row
    record = {"bench": "fsdp2", "case": case, "peer_of": peer_of, "preset": args.preset, "layers": layers, "world": world,
              "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "clip": args.clip, "lr": args.lr,
              "ckpt": args.ckpt, "offload": args.offload, "variant": variant, "deferred_loss": args.deferred_loss,
              "flops_per_token": model_flops, "torch": torch.__version__,
              "liger_kernel": lk["version"] if lk else None, "torchao": f8["version"] if f8 else None,
              **run_metadata(device.type), "oom": False}

    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # Built on the meta device and sharded before any memory is taken (a 7B model never exists whole on one
        # rank), then materialised on the GPU (the host with --offload) and initialised shard by shard.
        torch.manual_seed(1)
        with torch.device("meta"):
            model = Llama(vocab, hidden, layers, heads, kv_heads, ffn, ckpt=args.ckpt, lk=lk)
        if f8:  # torchtitan: the float8 converter runs on the meta-device model, before AC, compile and fully_shard
            emulate = device.type != "cuda"
            record.update({"float8_recipe": "tensorwise", "float8_all_gather": False, "float8_emulate": emulate,
                           "float8_linears": convert_float8(model, f8, emulate)})
        if args.compile:  # torchtitan: checkpoint wrapper, then compile, then fully_shard, block by block
            for i, block in enumerate(model.blocks):
                if args.ckpt:
                    block = checkpoint_wrapper(block, preserve_rng_state=False)
                # Liger 0.8.5 picks its RoPE backend in a torch.compiler.disable()d function, which a full graph
                # refuses: with --liger the blocks compile with graph breaks allowed (torch.compile's default)
                block.compile(fullgraph=not args.liger)
                model.blocks[i] = block
            model.wrapped = args.ckpt
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard = {"mp_policy": mp}
        if args.offload:
            shard["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs CUDA (CPU smoke runs)
        for block in model.blocks:
            fully_shard(block, **shard)
        fully_shard(model, **shard)
        model.to_empty(device="cpu" if args.offload else device)
        model.init_weights()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                fused=not args.offload and device.type == "cuda")

        def step(i, xy=None, read=True):
            x, y = xy if xy is not None else batch(args, vocab, tokens, i, rank, world, device)
            loss = model(x, y)
            loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item() if read else loss.detach()  # item() synchronises, as bench_table's loss read-back does

        for i in range(args.warmup):
            step(i)
        # --deferred-loss: the timed steps' batches on the device before the clock starts and their losses read after it
        # stops, as bench_table --deferred-loss has them (no step waits for the host).
        timed = {i: batch(args, vocab, tokens, i, rank, world, device) for i in range(args.warmup, args.warmup + args.steps)} \
            if args.deferred_loss else {}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = float("nan")
        for i in range(args.warmup, args.warmup + args.steps):
            loss = step(i, timed.get(i), read=not args.deferred_loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        time_ms = 1e3 * (time.perf_counter() - t0) / args.steps
        loss = float(loss)
        peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
        reserved_gb = torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else 0.0
        if args.profile_steps > 0:  # after the peaks and the clock, as bench_table's --profile-steps
            try:
                record["profile"] = profile_steps(lambda j: step(args.warmup + args.steps + j), args.profile_steps, device)
            except Exception as e:  # noqa: BLE001 — no profiler, an older torch: the row keeps what it measured
                record["profile_error"] = str(e).split("\n")[0][:300]

        # The slowest rank's time, the largest peaks, the mean loss.
        mx = torch.tensor([time_ms, peak_gb, reserved_gb], dtype=torch.float64, device=device)
        total = torch.tensor([loss], dtype=torch.float64, device=device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        time_ms, peak_gb, reserved_gb = mx.tolist()
        tps_gpu = args.batch * args.seq / (time_ms / 1e3)
        record.update({"time_ms": time_ms, "iters_per_s": 1e3 / time_ms, "tokens_per_s": tps_gpu * world,
                       "tokens_per_s_per_gpu": tps_gpu, "mfu": model_flops * tps_gpu / HOPPER_DENSE_BF16_FLOPS,
                       "peak_gb": peak_gb, "reserved_gb": reserved_gb, "final_loss": total.item() / world})
    except Exception as e:  # noqa: BLE001 — out of memory is a result; anything else an error; both end the run
        record["oom"] = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
        record["error"] = str(e).split("\n")[0][:300]
        print(f"fsdp2_llama rank {rank} of {world}: {case} failed: {record['error']}", file=sys.stderr, flush=True)
        if rank == 0:
            append_jsonl(args.out, [record])
        # Another rank may be inside a collective this one will never join: leave at once (torchrun then stops
        # the others; otherwise their NCCL timeout does).
        os._exit(1)

    if rank == 0:
        append_jsonl(args.out, [record])
        print(f"{case:<24} world {world} B {args.batch} T {args.seq}: peak {record['peak_gb']:.2f} GB/GPU, "
              f"{record['tokens_per_s']:.0f} tok/s ({record['tokens_per_s_per_gpu']:.0f}/GPU), MFU {record['mfu']:.3f}, "
              f"{record['time_ms']:.0f} ms/step, loss {record['final_loss']:.3f}", flush=True)
    dist.barrier()  # every rank is done with the group
    # Leave without tearing the process group down: its teardown aborted a rank now and then in CPU/gloo runs here
    # ("terminate called without an active exception"), after the results were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
