#!/usr/bin/env python3
"""Check squeeze's quantized checkpoints with the real clients, and squeeze's reader on files the clients wrote.

    python3 tools/check_quant_interop.py [--numpy-only] [--reader TEST_BINARY] [--read-dir DIR] [--cases A,B] FILES OUT.jsonl
FILES is what test_quant_interop's QuantInterop.WritesFilesForRealClients wrote (SQUEEZE_INTEROP_DIR): bnb-nf4/,
gptq-4bit/, gptq-3bit/, each with <case>-dequantized/ (squeeze's reading, dequantized, fp32) and
squeeze_quant_logits.safetensors. With --numpy-only --cases, the GPTQ directories named there instead, each beside its
<case>-dequantized/ (e.g. examples/llama_gptq's exports: test_llama_gptq_hf's LlamaGptqHf.WritesFilesForTheNumpyCheck).
One JSON line per check; exits 1 when a check fails.

bitsandbytes (needs torch, transformers, bitsandbytes and a CUDA device):
  - AutoModelForCausalLM.from_pretrained(bnb-nf4, device cuda, float32) against squeeze's logits of its dequantized
    weights: rel = max |a - b| / max |b| <= 1e-5 (fp32, the same network in another order of operations, TF32 off).
  - bitsandbytes.functional.dequantize_4bit of every Linear4bit of that model (its Params4bit and quant_state) against
    squeeze's dequantized weight: bit for bit (both compute code value * absmax' in fp32, absmax' = the nested code's
    map value * nested absmax + offset).
  - The reverse: bitsandbytes quantizes random fp32 weights (quantize_4bit nf4, blocksize 64, compress_statistics
    True and False, odd sizes) and the Linear4bit keys are saved with its dequantize_4bit into --read-dir
    (default FILES/bnb-read)/bnb_nf4.safetensors; with --reader, test_quant_interop's
    QuantInterop.ReadsFilesFromRealClients reads them there (bit for bit, squeeze's quantizer within 1e-3 of codes).
GPTQ: GPTQModel has no wheel that installs without a compiler, so the GPTQ checks use an independent numpy
reimplementation of its dequantization (below, written from GPTQModel's loader: 2/4/8-bit v1 zero points become v2 by
adding 0x55555555 / 0x11111111 / 0x01010101 to each int32 word; 3-bit ones field by field, (field + 1) mod 8;
W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])):
  - the layout as GPTQModel loads it: quantize_config.json agrees with config.json's quantization_config, every LLaMA
    linear of every layer is there (nothing else quantized), each with qweight I32 [in * bits / 32, out], qzeros I32
    [groups, out * bits / 32], scales F16 [groups, out], g_idx I32 [in] in [0, groups) (i // group_size without
    desc_act); groups = ceil(in / group_size), 1 for group_size -1;
  - against squeeze's dequantized weights: bit for bit (the product of an fp16 scale and a small integer is exact in
    fp32; GPTQModel's own kernels compute it in fp16, which rounds it to 2^-11 relative); the dense tensors
    (embeddings, norms, head) equal squeeze's values;
  - (not with --numpy-only) a plain LlamaForCausalLM (CPU, fp32) holding the reimplementation's weights and the file's
    fp16 dense tensors, against squeeze's logits: rel <= 1e-5.
--numpy-only runs the GPTQ weight checks alone (numpy, no torch): what ctest's quant_interop_numpy_gptq does.
"""
import argparse
import glob
import json
import os
import subprocess
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64, "U8": np.uint8}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        dtype = np.dtype(DTYPES[t["dtype"]])
        out[name] = np.frombuffer(data, dtype, (hi - lo) // dtype.itemsize, 8 + n + lo).reshape(t["shape"])
    return out


def read_dir(d):
    tensors = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        tensors.update(read_safetensors(f))
    return tensors


# ---- GPTQ, reimplemented from GPTQModel's dequantization --------------------------------------------------------
def unpack(words, bits, count):
    """int32 words [..., W] -> the `count` fields they hold along the last axis, as int64."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    mask = (1 << bits) - 1
    if bits in (2, 4, 8):  # 32 / bits fields a word, field j at bit bits * j
        shifts = np.arange(0, 32, bits, dtype=np.int64)
        return ((u[..., None] >> shifts) & mask).reshape(*u.shape[:-1], -1)[..., :count]
    assert bits == 3  # 32 fields in 3 words; fields 10 and 21 straddle two words
    pad = (-u.shape[-1]) % 3
    u = np.concatenate([u, np.zeros(u.shape[:-1] + (pad,), np.int64)], axis=-1).reshape(*u.shape[:-1], -1, 3)
    w0, w1, w2 = u[..., 0], u[..., 1], u[..., 2]
    fields = [(w0 >> (3 * k)) & 7 for k in range(10)]
    fields.append(((w0 >> 30) & 3) | ((w1 & 1) << 2))
    fields += [(w1 >> (1 + 3 * k)) & 7 for k in range(10)]
    fields.append(((w1 >> 31) & 1) | ((w2 & 3) << 1))
    fields += [(w2 >> (2 + 3 * k)) & 7 for k in range(10)]
    return np.stack(fields, axis=-1).reshape(*u.shape[:-2], -1)[..., :count]


def v1_zero_points(qzeros, bits, out):
    """qzeros [groups, W] of checkpoint_format "gptq" -> true zero points [groups, out], as GPTQModel loads them."""
    if bits == 3:
        return (unpack(qzeros, 3, out) + 1) & 7
    one_each = sum(1 << (bits * j) for j in range(32 // bits))
    words = ((qzeros.astype(np.int64) & 0xFFFFFFFF) + one_each) & 0xFFFFFFFF  # int32 addition, wrapping
    return unpack(words, bits, out)


def gptq_dequantize(t, module, bits):
    """W [out, in] float32 of GPTQ module `module` in tensors `t`."""
    scales = t[module + ".scales"].astype(np.float32)  # [groups, out]
    g_idx = t[module + ".g_idx"].astype(np.int64)      # [in]
    out, n_in = scales.shape[1], g_idx.shape[0]
    q = unpack(t[module + ".qweight"].T, bits, n_in)   # [out, in]: packed along the input dim
    z = v1_zero_points(t[module + ".qzeros"], bits, out)  # [groups, out]
    return (scales[g_idx].T * (q - z[g_idx].T).astype(np.float32)).astype(np.float32)


LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj")


def packed_words(n, bits):
    """int32 words holding n fields of `bits` bits: n * bits / 32 (GPTQModel's sizes are multiples of 32; the tiny
    fixtures' are not, and take the last word partly filled)."""
    return -(-n * bits // 32)


def layout_problems(t, config, qc):
    """What in GPTQ tensors `t` does not follow the layout GPTQModel loads, as a list of strings."""
    bits, group = qc["bits"], qc["group_size"]
    want = {f"model.layers.{i}.{m}" for i in range(config["num_hidden_layers"]) for m in LLAMA_LINEARS}
    have = {k[:-len(".qweight")] for k in t if k.endswith(".qweight")}
    problems = [f"missing {m}" for m in sorted(want - have)] + [f"unexpected {m}" for m in sorted(have - want)]
    for m in sorted(want & have):
        n_in = t[m + ".g_idx"].shape[0] if m + ".g_idx" in t else None
        out = t[m + ".scales"].shape[1] if m + ".scales" in t else None
        if n_in is None or out is None:
            problems.append(f"{m}: no g_idx or scales")
            continue
        groups = 1 if group == -1 else -(-n_in // group)
        expect = {".qweight": ((packed_words(n_in, bits), out), np.int32), ".qzeros": ((groups, packed_words(out, bits)), np.int32),
                  ".scales": ((groups, out), np.float16), ".g_idx": ((n_in,), np.int32)}
        for part, (shape, dtype) in expect.items():
            a = t.get(m + part)
            if a is None or a.shape != shape or a.dtype != dtype:
                problems.append(f"{m}{part}: {None if a is None else (a.shape, a.dtype)}, expected {(shape, np.dtype(dtype))}")
        g = t[m + ".g_idx"].astype(np.int64)
        if g.min() < 0 or g.max() >= groups:
            problems.append(f"{m}.g_idx outside [0, {groups})")
        elif not qc["desc_act"] and group != -1 and not np.array_equal(g, np.arange(n_in) // group):
            problems.append(f"{m}.g_idx is not i // group_size without desc_act")
    return problems


def gptq_checks(files, case, record, logits_check):
    d = os.path.join(files, case)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq", qc
    bits = qc["bits"]
    t, ours = read_dir(d), read_dir(d + "-dequantized")
    problems = layout_problems(t, config, qc)
    qc_file = os.path.join(d, "quantize_config.json")
    if os.path.exists(qc_file):
        with open(qc_file) as f:
            other = json.load(f)
        problems += [f"quantize_config.json {k}: {other.get(k)} vs {qc.get(k)}" for k in ("bits", "group_size", "desc_act", "sym")
                     if other.get(k) != qc.get(k)]
    record(f"{case}: the GPTQModel layout (count of problems)", "gptq-reimplementation", float(len(problems)), 0.0,
           problems=problems[:5])
    modules = sorted(k[:-len(".qweight")] for k in t if k.endswith(".qweight"))
    weights, differing, worst = {}, [], 0.0
    for m in modules:
        w = gptq_dequantize(t, m, bits)
        weights[m + ".weight"] = w
        s = ours[m + ".weight"]
        if w.shape != s.shape or not np.array_equal(w, s):
            differing.append(m)
            worst = max(worst, float(np.abs(w - s).max() / np.abs(s).max())) if w.shape == s.shape else float("inf")
    record(f"{case}: GPTQModel's dequantization (reimplemented) equals squeeze's (count of layers differing)",
           "gptq-reimplementation", float(len(differing)), 0.0, layers=len(modules), bits=bits, desc_act=qc["desc_act"],
           differing=differing[:5], max_rel=worst)
    dense_differing = []
    for k, v in t.items():
        if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
            weights[k] = v.astype(np.float32)
            if k not in ours or not np.array_equal(weights[k], ours[k]):
                dense_differing.append(k)
    record(f"{case}: the dense tensors equal squeeze's (count differing)", "gptq-reimplementation", float(len(dense_differing)), 0.0,
           differing=dense_differing[:5])
    if logits_check:
        logits_check(case, config, weights)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files")
    ap.add_argument("out")
    ap.add_argument("--numpy-only", action="store_true", help="the GPTQ weight checks alone (numpy, no torch)")
    ap.add_argument("--read-dir", help="where bitsandbytes' files for squeeze's reader go (default FILES/bnb-read)")
    ap.add_argument("--reader", help="test_quant_interop: run its ReadsFilesFromRealClients on them")
    ap.add_argument("--cases", help="with --numpy-only: the GPTQ directories under FILES to check, comma-separated "
                                    "(default gptq-4bit,gptq-3bit)")
    a = ap.parse_args()
    if a.cases and not a.numpy_only:
        ap.error("--cases needs --numpy-only (the other checks read test_quant_interop's files)")
    commit, date = os.environ.get("SQUEEZE_COMMIT", "unknown"), os.environ.get("SQUEEZE_DATE", "")
    versions = {"numpy": np.__version__}
    rows, ok = [], True

    def record(check, client, value, bound, **extra):
        nonlocal ok
        passed = value <= bound
        ok &= passed
        rows.append({"bench": "quant_interop", "case": check, "client": client, "value": value, "bound": bound, "pass": passed,
                     **versions, "commit": commit, "date": date, **extra})
        print(f"{'ok  ' if passed else 'FAIL'} {check}: {value:.3g} (bound {bound:g})")

    if a.numpy_only:
        for case in (a.cases or "gptq-4bit,gptq-3bit").split(","):
            gptq_checks(a.files, case, record, None)
    else:
        import torch
        import transformers
        import bitsandbytes as bnb
        import bitsandbytes.functional as F
        from safetensors.torch import save_file
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        versions.update(torch=torch.__version__, transformers=transformers.__version__, bitsandbytes=bnb.__version__)
        logits = {k: torch.from_numpy(v.copy()) for k, v in read_safetensors(os.path.join(a.files, "squeeze_quant_logits.safetensors")).items()}
        ids = logits["input_ids"]

        def rel(x, y):
            x, y = x.double(), y.double()
            return float((x - y).abs().max() / y.abs().max())

        with torch.no_grad():
            # bitsandbytes: transformers loads the directory; dequantize_4bit of each Linear4bit
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(a.files, "bnb-nf4"), device_map="cuda", dtype=torch.float32, attn_implementation="eager").eval()
            record("transformers loads the bitsandbytes NF4 directory (fp32 logits)", "transformers+bitsandbytes",
                   rel(model(ids.cuda()).logits.float().cpu(), logits["bnb_nf4_logits"]), 1e-5)
            ours = read_dir(os.path.join(a.files, "bnb-nf4-dequantized"))
            linears = [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
            differing = []
            for name, m in linears:
                w = F.dequantize_4bit(m.weight.data, m.weight.quant_state).float().cpu()
                if not torch.equal(w, torch.from_numpy(ours[name + ".weight"].copy())):
                    differing.append(name)
            record("bitsandbytes' dequantize_4bit equals squeeze's dequantized weights (count of layers differing)",
                   "bitsandbytes", float(len(differing)), 0.0, layers=len(linears), differing=differing[:5],
                   nested=bool(linears and linears[0][1].weight.quant_state.nested))
            expect = 7 * model.config.num_hidden_layers
            record(f"every LLaMA linear loaded as a Linear4bit (count missing of {expect})", "transformers+bitsandbytes",
                   float(expect - len(linears)), 0.0)
            del model

            # the reverse: bitsandbytes writes, squeeze reads
            read_dir_ = a.read_dir or os.path.join(a.files, "bnb-read")
            os.makedirs(read_dir_, exist_ok=True)
            g = torch.Generator().manual_seed(33)
            t = {}
            for n_out, n_in in ((37, 29), (3, 5), (65, 257)):  # odd sizes; 65 x 257: 262 blocks, 2 nested groups
                for nested in (False, True):
                    name = f"w{n_out}x{n_in}_{'nested' if nested else 'plain'}"
                    w = (torch.randn(n_out, n_in, generator=g) * 0.05).cuda()
                    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
                    t[name + ".weight"] = packed.cpu()
                    for k, v in qs.as_dict(packed=True).items():
                        t[f"{name}.weight.{k}"] = v.cpu()
                    t[name + ".dequantized"] = F.dequantize_4bit(packed, qs).float().cpu()
                    t[name + ".original"] = w.cpu()
            save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(read_dir_, "bnb_nf4.safetensors"),
                      metadata={"bitsandbytes": bnb.__version__, "torch": torch.__version__})
            if a.reader:
                r = subprocess.run([a.reader, "--gtest_filter=QuantInterop.ReadsFilesFromRealClients"],
                                   env={**os.environ, "SQUEEZE_INTEROP_READ_DIR": read_dir_}, capture_output=True, text=True)
                print(r.stdout[-4000:])
                skipped = "[  SKIPPED ]" in r.stdout
                record("squeeze reads bitsandbytes' NF4 weights to its dequantize_4bit (reader test exit code)", "bitsandbytes",
                       float(r.returncode or skipped), 0.0, measured=[ln for ln in r.stdout.splitlines() if "[ measured ]" in ln])

        def logits_check(case, config, weights):  # a plain LlamaForCausalLM holding the reimplementation's weights
            config = {k: v for k, v in config.items() if k != "quantization_config"}
            cfg = transformers.LlamaConfig.from_dict({**config, "attn_implementation": "eager"})
            m = transformers.LlamaForCausalLM(cfg).float().eval()
            missing, unexpected = m.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=False)
            assert not missing and not unexpected, (missing, unexpected)
            with torch.no_grad():
                record(f"{case}: LlamaForCausalLM with the reimplementation's weights (fp32 logits)", "gptq-reimplementation+transformers",
                       rel(m(ids).logits.float(), logits[case.replace("-", "_") + "_logits"]), 1e-5)

        for case in ("gptq-4bit", "gptq-3bit"):
            gptq_checks(a.files, case, record, logits_check)

    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
