#!/usr/bin/env python3
"""The transformers + bitsandbytes + PEFT peer of bench_table's `qlora` row: the same LLaMA geometry (the preset's
vocab, hidden, layers, heads, kv_heads, ffn; RoPE theta 1e4, RMSNorm eps 1e-5, untied head) as a
transformers LlamaForCausalLM, fine-tuned the way a QLoRA user does it:

  base        random weights (seed 1; N(0, 0.02), o_proj / down_proj N(0, 0.02/sqrt(2L)), norm gains 1, as
              nn::Llama), written once as a bf16 safetensors checkpoint (save_pretrained) to a local directory,
              then loaded with from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit,
              bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant, bnb_4bit_compute_dtype=bf16), dtype=bf16,
              attn_implementation="sdpa"): the seven projections of every block become bnb Linear4bit (NF4 codes,
              double-quantized block scales), embedding, norms and head stay bf16 (transformers keeps the head
              unquantized), as squeeze's Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>,
              Checkpointed> keeps them
  adapters    peft LoraConfig(r=8, lora_alpha=16, target_modules=q_proj,v_proj, lora_dropout=0, bias="none"),
              get_peft_model (fp32 adapter weights: PEFT's autocast_adapter_dtype); LoRA<8, 16>'s default targets q|v
  memory      gradient checkpointing per decoder layer (gradient_checkpointing_enable, use_reentrant=False), no KV
              cache; --prepare-kbit runs peft.prepare_model_for_kbit_training first (the classic recipe: it also
              casts the norms, embedding and head to fp32, which is not bf16 and costs speed and memory)
  optimizer   torch.optim.AdamW over the adapters (fused on the GPU), bench_table's settings for the LoRA rows: lr
              --lr (default the preset's, llama::default_lr; at llama-7b a 5-step linear warm-up unless --lr is
              given, as bench_table), betas 0.9/0.95, eps 1e-8, weight decay 0 (examples/llama/trainer.hpp gives
              LoRA strategies none), global gradient-norm clip --clip (1.0)
  loss        the mean next-token cross-entropy of all B·T targets in float, from the model's bf16 logits
              (transformers' own loss does the same upcast); x and y are windows of T+1 tokens, as bench_table's
  --liger     Liger-Kernel on the same model, as its README applies it to a transformers LLaMA:
              apply_liger_kernel_to_llama() before from_pretrained (its defaults: RoPE, RMSNorm, SwiGLU MLP and the
              fused linear cross-entropy), the loss taken by the model from shift_labels=y (the head and loss in
              chunks, no logits); case "hf-bnb-peft-qlora-liger", peer "peft-bnb-liger", liger_kernel its version

One JSON line per run (--out, appended), the fields of fsdp2_llama.py's:
  peak_gb       torch.cuda.max_memory_allocated, reset right before from_pretrained (after the random
                checkpoint was written and its bf16 model freed) and read after the last timed step: loading,
                quantization, the adapters and every step are inside, as bench_table's peak_gb is reset before the
                row's trainer is built and read after its last step (`peak_window` says so in the line)
  load_peak_gb  the same peak read once the PEFT model is ready (before the first step); model_gb the bytes
                allocated then; reserved_gb torch.cuda.max_memory_reserved over the same window as peak_gb
  time_ms       per timed step (after --warmup untimed ones), each step ending in loss.item() (a sync, as
                bench_table's loss read-back), torch.cuda.synchronize around the timed steps
  tokens_per_s  batch x seq per step over time_ms; mfu: flops_per_token x tokens_per_s / 989 TFLOP/s with
                flops_per_token = 6·N + 12·L·T·d, bench_table's formula and constant
  and bench "hf_qlora", case "hf-bnb-peft-qlora", peer "peft-bnb", peer_of "qlora" (the bench_table row it mirrors), preset,
  layers, world 1, batch, seq, steps, warmup, lr, lr_warmup, clip, lora_r, lora_alpha, lora_targets,
  trainable_params, quantized_linears, grad_ckpt, prepare_kbit, load_s, write_s, final_loss, losses, versions
  (torch, transformers, peft, bitsandbytes), device, date, commit (SQUEEZE_DEVICE / SQUEEZE_DATE / SQUEEZE_COMMIT).

Data: random tokens over the vocabulary, or byte windows of --corpus FILE (bench_table's byte-level tokens), drawn
as fsdp2_llama.py draws them (bench_common.batch). Throughput does not depend on which.

  python3 bench/qlora/qlora_peer.py --preset tinyllama-1.1b --batch 8 --seq 2048 --out qlora-peer.jsonl
  python3 bench/qlora/qlora_peer.py --preset tiny --device cpu --batch 2 --seq 64 --out /tmp/q.jsonl   # smoke run
A run that fails (out of memory included) writes its line with `oom` / `error` and exits 1.

The longest context: --seqs T1,T2,... (ascending) loads the model once and trains one step at each sequence length
(the peak reset before each), one line per length with `seq` set, until one runs out of memory (its line says so);
the largest that trained is the peer's longest context. The model's max_position_embeddings is the largest T.
"""
import argparse
import gc
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

# The base model is a local directory; the GPU machine has no network, so nothing is to be looked up on a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The presets, the FLOPs formula and peak constant, the learning rate, the data windows: bench_table's, shared.
from bench_common import (HOPPER_DENSE_BF16_FLOPS, NORM_EPS, PRESETS, ROPE_THETA, append_jsonl, batch, corpus_tokens,  # noqa: E402
                          add_run_arguments, default_lr, flops_per_token, profile_steps, require_positive, run_metadata)


def llama_config(vocab, hidden, layers, heads, kv_heads, ffn, seq):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_act="silu",
                       max_position_embeddings=max(2048, seq), rms_norm_eps=NORM_EPS,
                       rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False, use_cache=False)


def write_random_checkpoint(config, path, device):
    """A bf16 LlamaForCausalLM of `config` with nn::Llama's initialisation (seed 1), built on `device` and saved to
    `path` (safetensors) by save_pretrained: the stand-in for a downloaded base model. Returns seconds taken."""
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(1)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    residual_std = 0.02 / math.sqrt(2.0 * config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def checkpoint_matches(path, config):
    """Whether `path` already holds a checkpoint of this geometry (--model-dir reuse)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return False
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    return all(c.get(k) == getattr(config, k) for k in keys)


def load_qlora(path, args, device):
    """from_pretrained with NF4 + double quantization and bf16 compute, gradient checkpointing, LoRA adapters."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    if args.liger:  # patches transformers' LLaMA classes: before the model is made
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16,
                                             device_map={"": device.index if device.type == "cuda" else "cpu"},
                                             attn_implementation="sdpa")
    model.config.use_cache = False
    ckpt_kwargs = {"use_reentrant": False}
    if args.prepare_kbit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs=ckpt_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=args.targets.split(","), lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()  # from_pretrained returns eval mode; checkpointing runs in training mode only
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(ap, out_help="append the JSON line here", batch_help="sequences per step")
    ap.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: the preset's, as bench_table)")
    ap.add_argument("--lr-warmup", type=int, default=None, help="steps of linear warm-up (default: 5 at llama-7b without --lr, else 0)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    ap.add_argument("--alpha", type=int, default=16, help="LoRA alpha")
    ap.add_argument("--targets", default="q_proj,v_proj", help="LoRA target modules")
    ap.add_argument("--liger", action="store_true", help="Liger-Kernel's RoPE, RMSNorm, SwiGLU and fused linear cross-entropy")
    ap.add_argument("--deferred-loss", action="store_true",
                    help="the timed steps' losses read after the clock stops (no read-back syncs a step), as bench_table --deferred-loss")
    ap.add_argument("--prepare-kbit", action="store_true", help="peft.prepare_model_for_kbit_training first (fp32 norms, embedding, head)")
    ap.add_argument("--seqs", default="", help="ascending sequence lengths: one step at each until one runs out of memory")
    ap.add_argument("--gpu-gb", type=float, default=0.0, help="act as a GPU of this many GB (1e9 bytes): the caching allocator "
                                                              "is capped there, as bench_table --gpu-gb (0: the GPU's own)")
    ap.add_argument("--model-dir", default="", help="write the random bf16 checkpoint here and keep it (reused when it holds this "
                                                     "geometry); default: a temporary directory under TMPDIR, removed at the end")
    args = ap.parse_args()
    require_positive(args, ("batch", "seq", "steps", "rank"))
    if args.gpu_gb < 0:
        raise SystemExit(f"qlora_peer: --gpu-gb must be 0 (the GPU's own memory) or a size in GB, got {args.gpu_gb}")
    lr = args.lr if args.lr is not None else default_lr(args.preset)
    lr_warmup = args.lr_warmup if args.lr_warmup is not None else (5 if args.preset == "llama-7b" and args.lr is None else 0)

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("qlora_peer: no CUDA device; pass --device cpu for a smoke run")
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        if 0 < args.gpu_gb * 1e9 < total:  # the smaller card's out-of-memory, on a larger one
            torch.cuda.set_per_process_memory_fraction(args.gpu_gb * 1e9 / total, device)
    else:
        device = torch.device("cpu")

    import bitsandbytes
    import peft
    import transformers

    vocab, hidden, layers, heads, kv_heads, ffn = PRESETS[args.preset]
    if args.layers > 0:
        layers = args.layers
    seqs = [int(t) for t in args.seqs.split(",") if t.strip()] if args.seqs else []
    if seqs and (sorted(seqs) != seqs or seqs[0] <= 0):
        raise SystemExit(f"qlora_peer: --seqs must be ascending positive lengths, got {args.seqs}")
    config = llama_config(vocab, hidden, layers, heads, kv_heads, ffn, max(seqs + [args.seq]))
    tokens = corpus_tokens(args.corpus) if args.corpus else None
    model_flops = flops_per_token(vocab, hidden, layers, heads, kv_heads, ffn, args.seq)
    case = "hf-bnb-peft-qlora" + ("-kbit" if args.prepare_kbit else "") + ("-liger" if args.liger else "")
    liger_version = None
    if args.liger:
        from importlib.metadata import version as dist_version
        liger_version = dist_version("liger-kernel")
    record = {"bench": "hf_qlora", "case": case, "peer": "peft-bnb" + ("-liger" if args.liger else ""), "peer_of": "qlora", "preset": args.preset, "layers": layers, "world": 1,
              "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "lr": lr, "lr_warmup": lr_warmup,
              "clip": args.clip, "weight_decay": 0.0, "lora_r": args.rank, "lora_alpha": args.alpha, "lora_targets": args.targets,
              "quant": "nf4", "double_quant": True, "compute_dtype": "bfloat16", "grad_ckpt": True, "attn": "sdpa",
              "prepare_kbit": args.prepare_kbit, "flops_per_token": model_flops, "gpu_gb": args.gpu_gb,
              "peak_window": "reset before from_pretrained, read after the last timed step (bench_table: reset before the row's "
                             "trainer is built, read after its last step)",
              "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
              "bitsandbytes": bitsandbytes.__version__, "liger_kernel": liger_version, **run_metadata(device.type), "oom": False}

    def stopped(signum, frame):  # a timeout's SIGTERM: written as this run's error, the temporary checkpoint removed
        raise RuntimeError(f"stopped by signal {signum} (a timeout?)")

    signal.signal(signal.SIGTERM, stopped)
    keep = bool(args.model_dir)
    path = args.model_dir or tempfile.mkdtemp(prefix="qlora-peer-")
    try:
        if keep and checkpoint_matches(path, config):
            record["write_s"] = 0.0
        else:
            record["write_s"] = write_random_checkpoint(config, path, device)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        torch.manual_seed(1)  # the adapters' initialisation, whether the checkpoint was written now or reused
        model = load_qlora(path, args, device)
        import bitsandbytes.nn as bnb_nn

        nf4 = [m for m in model.modules() if isinstance(m, bnb_nn.Linear4bit)]
        record["quantized_linears"] = len(nf4)  # 7 per block; the head stays bf16
        states = [m.weight.quant_state for m in nf4]
        # As loaded, not as asked: "nf4", True, "bfloat16" when the quantization config took.
        record["quant"] = ",".join(sorted({s.quant_type for s in states}))
        record["double_quant"] = bool(states) and all(s.nested for s in states)
        record["compute_dtype"] = ",".join(sorted({str(m.compute_dtype).replace("torch.", "") for m in nf4}))
        trainable = [p for p in model.parameters() if p.requires_grad]
        record["trainable_params"] = sum(p.numel() for p in trainable)
        record["adapter_dtype"] = str(trainable[0].dtype).replace("torch.", "") if trainable else ""
        record["grad_ckpt"] = bool(getattr(model, "is_gradient_checkpointing", True))
        record["attn"] = getattr(model.config, "_attn_implementation", "sdpa")
        opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                fused=device.type == "cuda" and all(p.is_cuda and p.dtype == torch.float32 for p in trainable))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            record["load_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            record["model_gb"] = torch.cuda.memory_allocated(device) / 1e9
        record["load_s"] = time.perf_counter() - t0

        losses = []
        deferred = args.deferred_loss  # rebound to False for the profiled steps

        def step(i, x, y):
            for group in opt.param_groups:
                group["lr"] = lr * (i + 1) / lr_warmup if i < lr_warmup else lr
            if args.liger:  # the fused head + loss: y are the targets already shifted
                # contiguous: Liger flattens shift_labels with view(-1), and y is a window's [:, 1:] slice
                loss = model(input_ids=x, shift_labels=y.contiguous(), use_cache=False).loss
                if loss is None:
                    raise RuntimeError("qlora_peer --liger: the model returned no loss for shift_labels (is Liger's LLaMA forward in place?)")
            else:
                logits = model(input_ids=x, use_cache=False).logits  # [B, T, V] bf16
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
                del logits
            loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if deferred:  # read after the clock stops, as bench_table --deferred-loss
                losses.append(loss.detach())
                return float("nan")
            losses.append(loss.item())  # synchronises, as bench_table's loss read-back does
            return losses[-1]

        if seqs:  # the longest context: one step at each length until one runs out of memory
            for T in seqs:
                args.seq = T
                row = dict(record, seq=T, steps=1, warmup=0, flops_per_token=flops_per_token(vocab, hidden, layers, heads, kv_heads, ffn, T))
                try:
                    x, y = batch(args, vocab, tokens, 0, 0, 1, device)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    loss = step(0, x, y)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    time_ms = 1e3 * (time.perf_counter() - t0)
                    tps = args.batch * T / (time_ms / 1e3)
                    row.update({"time_ms": time_ms, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps, "final_loss": loss,
                                "mfu": row["flops_per_token"] * tps / HOPPER_DENSE_BF16_FLOPS})
                    if device.type == "cuda":
                        row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                    print(f"{case} {args.preset} B {args.batch} T {T}: trained, peak {row.get('peak_gb', 0):.2f} GB, {tps:.0f} tok/s", flush=True)
                    append_jsonl(args.out, [row])
                except torch.OutOfMemoryError as e:
                    row.update({"oom": True, "error": str(e).split("\n")[0][:300]})
                    append_jsonl(args.out, [row])
                    print(f"{case} {args.preset} B {args.batch} T {T}: out of memory", flush=True)
                    break
                finally:
                    opt.zero_grad(set_to_none=True)
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            return

        for i in range(args.warmup):
            step(i, *batch(args, vocab, tokens, i, 0, 1, device))
        # The timed steps' batches are on the device before the clock starts, as bench_table's run_steps has them.
        timed = [(i, *batch(args, vocab, tokens, i, 0, 1, device)) for i in range(args.warmup, args.warmup + args.steps)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = float("nan")
        for i, x, y in timed:
            loss = step(i, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        time_ms = 1e3 * (time.perf_counter() - t0) / args.steps
        losses[:] = [float(v) for v in losses]  # the deferred ones read now
        loss = losses[-1]
        deferred = False  # the profiled steps read theirs as the plain run does
        tps = args.batch * args.seq / (time_ms / 1e3)
        record.update({"deferred_loss": args.deferred_loss, "time_ms": time_ms, "iters_per_s": 1e3 / time_ms, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps,
                       "mfu": model_flops * tps / HOPPER_DENSE_BF16_FLOPS, "final_loss": loss, "losses": list(losses)})
        if device.type == "cuda":
            record["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            record["reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
        if args.profile_steps > 0:  # after the peaks and the clock, as bench_table's --profile-steps
            first = args.warmup + args.steps
            more = [(first + j, *batch(args, vocab, tokens, first + j, 0, 1, device)) for j in range(args.profile_steps)]
            try:
                record["profile"] = profile_steps(lambda j: step(*more[j]), args.profile_steps, device)
            except Exception as e:  # noqa: BLE001 — no profiler, an older torch: the row keeps what it measured
                record["profile_error"] = str(e).split("\n")[0][:300]
    except Exception as e:  # noqa: BLE001 — out of memory is a result; anything else an error; both are written
        record["oom"] = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
        record["error"] = (str(e).split("\n")[0] or type(e).__name__)[:300]
        print(f"qlora_peer: {case} {args.preset} failed: {type(e).__name__}: {record['error']}", file=sys.stderr, flush=True)
        if not record["oom"]:  # where it failed, for the log
            traceback.print_exc(file=sys.stderr)
        append_jsonl(args.out, [record])
        sys.exit(1)
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)

    append_jsonl(args.out, [record])
    peak = f"peak {record['peak_gb']:.2f} GB (loaded {record['load_peak_gb']:.2f}), " if "peak_gb" in record else ""
    print(f"{case:<20} {args.preset} B {args.batch} T {args.seq}: {peak}{record['tokens_per_s']:.0f} tok/s, MFU {record['mfu']:.3f}, "
          f"{record['time_ms']:.0f} ms/step, loss {record['final_loss']:.3f}; {record['quantized_linears']} NF4 linears, "
          f"{record['trainable_params']} {record['adapter_dtype']} adapter values; checkpoint written in {record['write_s']:.1f} s, "
          f"loaded in {record['load_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
