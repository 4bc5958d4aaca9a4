#!/usr/bin/env python3
"""Write the Hugging Face fixtures the CPU tests read (tests/fixtures/hf/), with the real libraries.

Run where PyTorch, transformers, safetensors and sentencepiece are installed (the GPU machine; a CPU is enough):
    python3 tools/make_hf_fixtures.py OUT_DIR [--corpus TEXT_FILE]
    python3 tools/make_hf_fixtures.py OUT_DIR --llama-7b     # only OUT_DIR/llama-7b (for benchmarks, not committed)
Writes, each model saved sharded by transformers' save_pretrained:
    llama2-tiny/   LLaMA-2 style: fp32 weights, multi-head attention, untied head, rope_theta 10000
    llama3-tiny/   LLaMA-3 style: bf16 weights, grouped-query attention (4 heads, 2 kv heads), head_dim 24 with
                   hidden 64, rope type "llama3", tied embeddings
    each with expected.safetensors: input_ids [2, 11] (int64), logits_fp32 [2, 11, vocab] (the saved directory loaded
    by from_pretrained in fp32), logits_bf16 [2, 11, vocab] (loaded in bf16; stored as fp32)
    spm-tiny/      tokenizer.model (SentencePiece BPE, 288 pieces, byte fallback) and encodings.json
    versions.json  the library versions that wrote them
With --llama-7b: llama-7b/, the LLaMA-7B geometry (squeeze's llama-7b preset) with transformers' random
initialisation in bf16, saved in shards of at most 5 GB as the published LLaMA-2 checkpoints are (13.5 GB; built on the
GPU when there is one). What bench/hf loads and bench/quant quantizes.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
import sentencepiece as spm

VOCAB = 288  # not a power of two, so no kernel gets a friendly size


def rope_config(theta, scaling=None):
    """The RoPE keys in the spelling of the installed transformers (5.x: rope_parameters; 4.x: theta + scaling)."""
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    out = {"rope_theta": theta}
    if scaling:
        out["rope_scaling"] = dict(scaling)
    return out


def make_model(out_dir, name, dtype, seed, **config_kwargs):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, **config_kwargs)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    # Random norms too (they start at one), so a loader that skipped them would not pass.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    path = os.path.join(out_dir, name)
    model.save_pretrained(path, max_shard_size="150KB", safe_serialization=True)

    # The references come from the saved directory as a user loads it: in fp32 (a bf16 file's weights widened, RoPE
    # frequencies computed in fp32) and in bf16.
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, VOCAB, (2, 11), generator=g)
    logits = {}
    with torch.no_grad():
        for key, dt in (("logits_fp32", torch.float32), ("logits_bf16", torch.bfloat16)):
            loaded = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="eager").eval()
            logits[key] = loaded(input_ids).logits.float().contiguous()
    save_file({"input_ids": input_ids.contiguous(), **logits}, os.path.join(path, "expected.safetensors"))
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, files {sorted(os.listdir(path))}")


def make_random_llama_7b(out_dir):
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
                                      max_position_embeddings=4096, tie_word_embeddings=False, **rope_config(10000.0))
    # Built straight in bf16 on the device: a float copy on the host would be 27 GB and its initialisation minutes.
    torch.manual_seed(7)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    path = os.path.join(out_dir, "llama-7b")
    model.save_pretrained(path, max_shard_size="5GB", safe_serialization=True)
    print(f"llama-7b: {sum(p.numel() for p in model.parameters())} parameters, files {sorted(os.listdir(path))}")


def make_sentencepiece(out_dir, corpus):
    path = os.path.join(out_dir, "spm-tiny")
    os.makedirs(path, exist_ok=True)
    if corpus:
        with open(corpus, encoding="utf-8") as f:
            lines = [line.strip() for _, line in zip(range(4000), f) if line.strip()]
    else:
        lines = ["In the beginning God created the heaven and the earth."] * 50
    train_txt = os.path.join(path, "train.txt")
    with open(train_txt, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    # LLaMA's tokenizer settings where they matter for encoding: BPE, byte fallback, digits split, no normalization,
    # whitespace kept, <unk> <s> </s>.
    spm.SentencePieceTrainer.train(input=train_txt, model_prefix=os.path.join(path, "tokenizer"), vocab_size=512,
                                   model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=0.995,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    os.remove(train_txt)
    os.remove(os.path.join(path, "tokenizer.vocab"))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))
    texts = ["In the beginning God created the heaven and the earth.",
             "And the LORD said, 1234 or 56?",
             "  leading spaces, tabs\tand newlines\nend",
             "naïve café — ünïcödé ✓ 日本",
             ""]
    encodings = [{"text": t, "ids": sp.encode(t), "pieces": sp.encode(t, out_type=str)} for t in texts]
    with open(os.path.join(path, "encodings.json"), "w", encoding="utf-8") as f:
        json.dump({"vocab_size": sp.get_piece_size(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id(),
                   "unk_id": sp.unk_id(), "encodings": encodings}, f, ensure_ascii=False, indent=1)
    print(f"spm-tiny: {sp.get_piece_size()} pieces")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--corpus")
    ap.add_argument("--llama-7b", action="store_true", help="write only llama-7b/ (random weights, 13.5 GB)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.llama_7b:
        make_random_llama_7b(args.out)
        return 0
    make_model(args.out, "llama2-tiny", torch.float32, 7, hidden_size=64, intermediate_size=172,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
               max_position_embeddings=128, tie_word_embeddings=False, **rope_config(10000.0))
    make_model(args.out, "llama3-tiny", torch.bfloat16, 11, hidden_size=64, intermediate_size=150,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5,
               max_position_embeddings=256, tie_word_embeddings=True,
               **rope_config(500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    make_sentencepiece(args.out, args.corpus)
    with open(os.path.join(args.out, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__,
                   "sentencepiece": spm.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
