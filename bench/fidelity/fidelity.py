#!/usr/bin/env python3
"""Fidelity of the LLaMA example's training strategies: validation perplexity over seeds at equal tokens.

    fidelity.py run       --binary build/bin/llama_train --preset 125m --device cuda --steps 1221 --seeds 1,2,3 \\
                          --runs runs.jsonl --work fidelity-work [--strategies fp32,bf16,...] [--budget-s 480]
    fidelity.py summarize --runs runs.jsonl --out fidelity.jsonl
    fidelity.py corpora   --out DIR [--kjv kjv.txt]          (DIR/kjv.txt, DIR/ot.txt, DIR/nt.txt)
    fidelity.py finetune  --binary ... --base-corpus DIR/ot.txt --ft-corpus DIR/nt.txt --runs ft-runs.jsonl \\
                          --work ft-work --out finetune.jsonl
    fidelity.py selfcheck --binary build/bin/llama_train --corpus tests/fixtures/text/genesis-1-3.txt --work DIR
    fidelity.py selftest                                     (the statistics on fixed numbers; no binary)

`run` starts llama_train once per (strategy, seed) with the same steps x batch x seq (so the same tokens) and
appends each run's --result-json to the runs file; a run already in that file is not run again, so a later call
with another --strategies subset, more seeds or a larger budget adds to it. `summarize` turns the runs into one
line per (preset, tokens, strategy): mean and sample standard deviation of the validation perplexity over the
seeds, the ratio to fp32's mean, and whether it is within the target. `finetune` trains one bf16 base, exports
it as a Hugging Face directory, and fine-tunes it on a second corpus by full fine-tuning, LoRA, QLoRA and
GPTQ-format 4-bit + LoRA for equal tokens. The standard library is all it needs (the chart is chart.py).
"""
import argparse
import datetime
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import bench_common  # noqa: E402  (the run metadata and JSON-lines files, as the other Python benchmarks)

# The fields every summary line carries (README.md, "Output"); selfcheck verifies them.
FIDELITY_FIELDS = ("bench", "case", "strategy", "preset", "tokens", "seeds", "ppl_mean", "ppl_std", "ratio_vs_fp32", "within_target",
                   "device", "commit", "date")
FINETUNE_FIELDS = ("bench", "case", "method", "strategy", "preset", "tokens", "seeds", "base_ppl", "start_ppl", "ppl_mean", "ppl_std",
                   "improvement", "share_of_full", "device", "commit", "date")
# The issue's targets: within 1% of fp32 (or within two seed standard deviations); QLoRA >= 90% of full fine-tuning's gain.
PPL_TOLERANCE = 0.01
SPREAD_FACTOR = 2.0
SHARE_TARGET = 0.90
# Fine-tuning methods: name -> llama_train strategy. "full" trains every weight in bf16 (with fp32 masters);
# the others train LoRA adapters on the frozen base: dense bf16, NF4 + DoubleQuant, 4-bit GPTQ layout (RTN values).
METHODS = {"full": "bf16", "lora": "lora", "qlora": "qlora", "qlora-all": "qlora-all", "gptq4-lora": "gptq4-lora"}
# Old / New Testament boundary of the KJV as the `bible` program prints it: 23,145 verses from Genesis 1:1 to
# Malachi 4:6, 31,102 in all; the first New Testament verse opens like this.
KJV_VERSES, KJV_OT_VERSES = 31102, 23145
KJV_NT_FIRST = "The book of the generation of Jesus Christ"


def fail(msg):
    raise SystemExit("fidelity.py: " + msg)


def commit_of():
    """SQUEEZE_COMMIT (bench_common.run_metadata, as run_h200.sh sets it), else this checkout's HEAD."""
    if bench_common.run_metadata("")["commit"]:
        return bench_common.run_metadata("")["commit"]
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def date_now():
    return bench_common.run_metadata("")["date"] or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def int_list(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"'{text}' is not a comma-separated list of integers")


# ---- statistics -------------------------------------------------------------------------------------------
def mean(xs):
    if not xs:
        raise ValueError("mean of no values")
    return math.fsum(xs) / len(xs)


def sample_std(xs):
    """Standard deviation with Bessel's correction (n - 1); None for fewer than two values."""
    if len(xs) < 2:
        return None
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def pooled_spread(a, b):
    """The seed spread that a difference of two means is judged against: the root mean square of the two
    standard deviations (None if either is unknown)."""
    if a is None or b is None:
        return None
    return math.sqrt((a * a + b * b) / 2)


def within_target(m, s, ref_m, ref_s):
    """Within 1% of the reference's mean, or the difference inside two standard deviations of the seed spread."""
    diff = abs(m - ref_m)
    if diff <= PPL_TOLERANCE * ref_m:
        return True
    spread = pooled_spread(s, ref_s)
    return spread is not None and diff <= SPREAD_FACTOR * spread


# ---- llama_train --------------------------------------------------------------------------------------------
def strategies_of(binary):
    """The --strategy names compiled into llama_train, in its order (CLI11 prints them as {a,b,...} in --help)."""
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=120)
    except OSError as e:
        fail(f"cannot run {binary} --help: {e}")
    return parse_strategies(out.stdout + out.stderr, binary)


def parse_strategies(help_text, source):
    m = re.search(r"--strategy\b[^{\n]*\{([^{}]*)\}", help_text)
    if not m:
        fail(f"{source} --help lists no '--strategy ...{{names}}': is it llama_train?")
    names = [n.strip() for n in m.group(1).replace("\n", " ").split(",") if n.strip()]
    if "fp32" not in names:
        fail(f"{source} has no fp32 strategy (the reference): {names}")
    return names


def corpus_name(path):
    return os.path.basename(path) if path else "default"


class Runner:
    """Runs llama_train for one configuration at a time, appends each result to the runs file, skips what that file
    already holds, and keeps to a wall-clock budget (a run that cannot finish in it is left for a later call).
    run() may be called from `jobs` threads at once: a small model leaves most of a GPU idle, so runs share it."""

    def __init__(self, binary, work, runs_path, budget_s=None, quiet=False, jobs=1):
        self.binary, self.work, self.runs_path, self.quiet, self.jobs = binary, work, runs_path, quiet, jobs
        self.lock = threading.Lock()  # guards everything below and the runs file
        self.deadline = time.monotonic() + budget_s if budget_s is not None else None
        self.done, self.ran, self.left, self.failed = {}, 0, [], []
        self.durations = {}  # (kind, strategy) -> seconds of its last run in this call, to judge what still fits
        os.makedirs(os.path.join(work, "results"), exist_ok=True)
        os.makedirs(os.path.join(work, "logs"), exist_ok=True)
        self.past = {}  # the same configuration but the seed -> wall seconds of a run in an earlier call
        for rec in read_jsonl(runs_path):
            self.done[config_key(rec["config"])] = rec
            self.past[seedless_key(rec["config"])] = rec.get("wall_s", 0.0)

    def say(self, msg):
        if not self.quiet:
            print(msg, flush=True)

    def slug(self, config):
        h = hashlib.sha1(config_key(config).encode()).hexdigest()[:10]
        return f"{config['kind']}-{config.get('preset') or 'hf'}-{config['strategy']}-s{config['seed']}-{h}"

    def run(self, config, args, resume_dir=None):
        """The record of this configuration: from the runs file, or by running llama_train; None if it failed or
        did not fit the budget."""
        key = config_key(config)
        slug = self.slug(config)
        label = f"{config['kind']} {config.get('preset') or ''} {config['strategy']} seed {config['seed']}".replace("  ", " ")
        with self.lock:
            if key in self.done:
                return self.done[key]
            if self.deadline is not None:
                remaining = self.deadline - time.monotonic()
                estimate = self.durations.get((config["kind"], config["strategy"])) or self.past.get(seedless_key(config), 0.0)
                if resume_dir is not None and os.path.exists(os.path.join(resume_dir, "latest")):
                    estimate = 0.0  # part of it is done: let it go on as far as the budget takes it
                if remaining <= 0 or estimate > remaining:
                    self.left.append(label)
                    return None
        result_path = os.path.join(self.work, "results", slug + ".json")
        log_path = os.path.join(self.work, "logs", slug + ".log")
        if os.path.exists(result_path):
            os.remove(result_path)
        cmd = [self.binary] + [str(a) for a in args] + ["--result-json", result_path]
        if resume_dir is not None:
            cmd += ["--save", resume_dir]
            if os.path.exists(os.path.join(resume_dir, "latest")):
                cmd += ["--load", resume_dir]
        t0 = time.monotonic()
        timeout = None if self.deadline is None else max(1.0, self.deadline - t0)
        with open(log_path, "w") as log:
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            # Its own process group, so a run stopped at the budget takes its threads and children with it.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                with self.lock:
                    self.left.append(label + " (stopped at the budget" + ("; resumes from its checkpoint" if resume_dir else "") + ")")
                return None
        wall = time.monotonic() - t0
        with self.lock:
            self.durations[(config["kind"], config["strategy"])] = wall
            if rc != 0 or not os.path.exists(result_path):
                tail = open(log_path, errors="replace").read().strip().splitlines()[-3:]
                why = f"exit code {rc}" if rc != 0 else "no --result-json file"
                self.failed.append(f"{label}: {why}: " + " | ".join(tail))
                self.say(f"  FAILED {label}: {why} (log: {log_path})")
                return None
            with open(result_path) as f:
                result = json.load(f)
            # concurrent_runs: how many runs shared the GPU (their tokens/s is then a share of it; the perplexity is not affected)
            rec = {"bench": "fidelity-run", "config": config, "result": result, "wall_s": round(wall, 2), "concurrent_runs": self.jobs,
                   "commit": commit_of(), "date": date_now(), "gpu": bench_common.run_metadata("")["device"],
                   "run_id": f"{slug}-{int(time.time() * 1000)}", "log": os.path.basename(log_path), "command": shlex.join(cmd)}
            os.makedirs(os.path.dirname(os.path.abspath(self.runs_path)), exist_ok=True)
            bench_common.append_jsonl(self.runs_path, [rec])
            self.done[key] = rec
            self.ran += 1
        ppl = result.get("val_ppl")
        self.say(f"  {label}: validation perplexity {ppl if ppl is None else f'{ppl:.4f}'}, {result.get('tokens')} tokens, {wall:.1f} s")
        return rec

    def report(self):  # printed even when quiet: what this call did
        print(f"{self.ran} run(s) this call, {len(self.failed)} failed, {len(self.left)} left for a later call", flush=True)
        for f in self.failed:
            print("  failed: " + f)
        for item in self.left:
            print("  left: " + item)


def config_key(config):
    return json.dumps(config, sort_keys=True)


def seedless_key(config):
    return config_key({k: v for k, v in config.items() if k != "seed"})


def read_jsonl(path):
    """The records of a JSON-lines file; none while it does not exist yet (a first call)."""
    if not path or not os.path.exists(path):
        return []
    try:
        return list(bench_common.read_jsonl([path], "fidelity.py"))
    except json.JSONDecodeError as e:
        fail(f"{path}: not a JSON-lines file ({e})")


def write_jsonl(path, objs):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for o in objs:
            f.write(json.dumps(o) + "\n")
    os.replace(tmp, path)


# ---- fidelity: the strategies from scratch ----------------------------------------------------------------------
def steps_for(args):
    tokens_per_step = args.batch * args.seq
    if args.steps:
        return args.steps
    if not args.tokens:
        fail("give --steps or --tokens")
    return -(-args.tokens // tokens_per_step)  # the fewest steps that reach --tokens


def pretrain_config(args, strategy, seed, steps):
    return {"kind": "pretrain", "preset": args.preset, "strategy": strategy, "seed": seed, "steps": steps, "batch": args.batch,
            "seq": args.seq, "lr": args.lr, "eval_batches": args.eval_batches, "device": args.device,
            "corpus": corpus_name(args.corpus), "extra": args.extra_args or ""}


def pretrain_args(args, strategy, seed, steps, eval_every):
    a = ["--preset", args.preset, "--strategy", strategy, "--seed", seed, "--steps", steps, "--batch", args.batch, "--seq", args.seq,
         "--eval-batches", args.eval_batches, "--eval-every", eval_every, "--sample", 0, "--device", args.device]
    if args.lr is not None:
        a += ["--lr", args.lr]
    if args.corpus:
        a += ["--corpus", args.corpus]
    if args.threads:
        a += ["--threads", args.threads]
    return a + shlex.split(args.extra_args or "")


def cmd_run(args):
    known = strategies_of(args.binary)
    if args.strategies in (None, "", "all"):
        wanted = known
    else:
        wanted = [s for s in args.strategies.split(",") if s]
        unknown = [s for s in wanted if s not in known]
        if unknown:
            fail(f"--strategies: {', '.join(unknown)} not in this llama_train ({', '.join(known)})")
    order = ["fp32"] + [s for s in wanted if s != "fp32"] if "fp32" in wanted else wanted  # the reference first
    seeds, steps = int_list(args.seeds), steps_for(args)
    if args.jobs < 1:
        fail(f"--jobs {args.jobs}: at least 1")
    runner = Runner(args.binary, args.work, args.runs, args.budget_s, args.quiet, args.jobs)
    runner.say(f"fidelity: {args.preset}, {len(order)} strategies x {len(seeds)} seeds, {steps} steps of {args.batch} x {args.seq} "
               f"= {steps * args.batch * args.seq} tokens each" + (f", budget {args.budget_s:.0f} s" if args.budget_s else "") +
               (f", {args.jobs} runs at a time" if args.jobs > 1 else ""))

    def one(strategy, seed):
        resume = None
        if args.ckpt_root:
            resume = os.path.join(args.ckpt_root, runner.slug(pretrain_config(args, strategy, seed, steps)))
        eval_every = args.save_every if args.ckpt_root else 0
        rec = runner.run(pretrain_config(args, strategy, seed, steps), pretrain_args(args, strategy, seed, steps, eval_every), resume)
        if rec is not None and resume and os.path.isdir(resume) and not args.keep_checkpoints:
            shutil.rmtree(resume)  # finished: its checkpoints are no longer needed

    # In order (the reference first); with --jobs N the next configuration starts as soon as one of N ends.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for f in [pool.submit(one, strategy, seed) for strategy in order for seed in seeds]:
            f.result()
    runner.report()
    if args.out:
        lines = summarize(read_jsonl(args.runs))
        write_jsonl(args.out, lines)
        print_summary(lines)
    return 1 if runner.failed else 0


def summarize(records, reference="fp32"):
    """One line per (setting, strategy) from the runs' records; the setting is everything but strategy and seed. Ratios
    are to fp32; a `reference` other than fp32 (a policy's exact twin, e.g. bf16-ckpt for its 8-bit checkpoints) adds
    ratio_vs_reference and its paired mean and spread."""
    groups = {}  # setting key -> strategy -> seed -> record (the latest record of a seed wins)
    order = []
    for rec in records:
        c = rec.get("config", {})
        if c.get("kind") != "pretrain":
            continue
        setting = {k: v for k, v in c.items() if k not in ("strategy", "seed")}
        skey = config_key(setting)
        if skey not in groups:
            groups[skey] = {"setting": setting, "by": {}}
            order.append(skey)
        groups[skey]["by"].setdefault(c["strategy"], {})[c["seed"]] = rec
    lines = []
    for skey in order:
        g = groups[skey]
        setting, by = g["setting"], g["by"]
        stats = {}
        for strategy, seeds in by.items():
            recs = [seeds[s] for s in sorted(seeds)]
            ppl = [r["result"]["val_ppl"] for r in recs]
            if any(p is None for p in ppl):
                continue  # a run without a finite perplexity (diverged): reported by its own line below
            stats[strategy] = (sorted(seeds), ppl, recs)
        ref = stats.get("fp32")
        ref_mean = mean(ref[1]) if ref else None
        ref_std = sample_std(ref[1]) if ref else None
        for strategy, seeds in by.items():
            recs = [seeds[s] for s in sorted(seeds)]
            results = [r["result"] for r in recs]
            tokens = sorted({r["tokens"] for r in results})
            line = {"bench": "fidelity", "case": f"{strategy} {setting['preset']}", "peer": "fp32", "strategy": strategy,
                    "preset": setting["preset"], "tokens": tokens[0] if len(tokens) == 1 else tokens,
                    "seeds": sorted(seeds), "steps": setting["steps"], "batch": setting["batch"], "seq": setting["seq"],
                    "lr": results[0].get("lr"), "device": device_of(recs), "train_device": setting["device"], "corpus": setting["corpus"],
                    "lora": bool(results[0].get("lora")),
                    "commit": ",".join(sorted({r["commit"] for r in recs})), "date": max(r["date"] for r in recs)}
            if strategy not in stats:
                line.update({"ppl_mean": None, "ppl_std": None, "ratio_vs_fp32": None, "within_target": False,
                             "ppl_per_seed": [r.get("val_ppl") for r in results], "note": "a seed ended without a finite perplexity"})
                lines.append(line)
                continue
            _, ppl, _ = stats[strategy]
            m, s = mean(ppl), sample_std(ppl)
            line.update({"ppl_mean": m, "ppl_std": s, "ppl_per_seed": ppl})
            if ref:
                line["ratio_vs_fp32"] = m / ref_mean
                line["ratio_std"] = None if s is None else s / ref_mean  # the seed spread on the ratio's scale
                paired = [seeds[x]["result"]["val_ppl"] / ref[2][ref[0].index(x)]["result"]["val_ppl"] for x in sorted(seeds) if x in ref[0]]
                line["ratio_paired_mean"] = mean(paired) if paired else None
                line["ratio_paired_std"] = sample_std(paired)
                line["within_target"] = within_target(m, s, ref_mean, ref_std)
            else:
                line["ratio_vs_fp32"] = None
                line["within_target"] = None  # no fp32 runs at this setting yet
            other = stats.get(reference) if reference != "fp32" else None
            if other:
                line["reference"] = reference
                line["ratio_vs_reference"] = m / mean(other[1])
                paired = [seeds[x]["result"]["val_ppl"] / other[2][other[0].index(x)]["result"]["val_ppl"] for x in sorted(seeds) if x in other[0]]
                line["ratio_paired_vs_reference_mean"] = mean(paired) if paired else None
                line["ratio_paired_vs_reference_std"] = sample_std(paired)
            line.update(speed_of(recs))
            lines.append(line)
    return lines


def speed_of(recs):
    """tokens_per_s_mean over the runs that had the GPU to themselves (records older than concurrent_runs did), None if
    every run shared it: a shared run's tokens/s is a share of the GPU, not the strategy's speed. The peak memory is
    each process's own, so it counts from every run."""
    alone = [r["result"]["tokens_per_s"] for r in recs if r.get("concurrent_runs", 1) == 1]
    return {"tokens_per_s_mean": mean(alone) if alone else None, "tokens_per_s_runs": len(alone),
            "concurrent_runs": sorted({r.get("concurrent_runs", 1) for r in recs}),
            "peak_gb_max": max(r["result"]["peak_gb"] for r in recs)}


def device_of(recs):
    """The GPU the runs ran on (SQUEEZE_DEVICE, as bench/run_gpu.sh sets it), else llama_train's --device."""
    return ",".join(sorted({r.get("gpu") or r["config"].get("device", "?") for r in recs}))


def fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def print_summary(lines):
    for ln in lines:
        if ln.get("bench") != "fidelity":
            continue
        print(f"{ln['preset']:>14} {ln['strategy']:<30} {len(ln['seeds'])} seeds  ppl {fmt(ln['ppl_mean'])} ± {fmt(ln['ppl_std'])}  "
              f"x fp32 {fmt(ln.get('ratio_vs_fp32'))} ± {fmt(ln.get('ratio_std'))}  "
              f"{'within target' if ln.get('within_target') else ('no fp32 yet' if ln.get('within_target') is None else 'OUTSIDE target')}")


def cmd_summarize(args):
    records = []
    for path in args.runs:
        records += read_jsonl(path)
    if not records:
        fail("no runs in " + ", ".join(args.runs))
    lines = summarize(records, args.reference) + summarize_finetune(records)
    write_jsonl(args.out, lines)
    print_summary(lines)
    print_finetune(lines)
    print("wrote", args.out)


# ---- the corpora -------------------------------------------------------------------------------------------------
def kjv_lines(kjv):
    """The KJV one verse per line without references: from a file (the `bible` program's text, as kjv.txt in a
    snapshot) or from the `bible` program (Debian's bible-kjv)."""
    if kjv:
        with open(kjv) as f:
            lines = f.read().splitlines()
    else:
        if shutil.which("bible") is None:
            fail("no --kjv file and no `bible` program (apt-get install bible-kjv)")
        out = subprocess.run(["bible", "-f", "Genesis 1:1-Revelation 22:21"], capture_output=True, text=True, check=True).stdout
        lines = [ln.split(" ", 1)[1] if " " in ln else "" for ln in out.splitlines()]  # "Ge1:1 In the ..." -> "In the ..."
    if len(lines) != KJV_VERSES or not lines[KJV_OT_VERSES].startswith(KJV_NT_FIRST):
        fail(f"{kjv or 'bible'}: expected {KJV_VERSES} verses with Matthew 1:1 at line {KJV_OT_VERSES + 1}, got {len(lines)} lines"
             + (f" and '{lines[KJV_OT_VERSES][:40]}' there" if len(lines) > KJV_OT_VERSES else ""))
    return lines


def cmd_corpora(args):
    lines = kjv_lines(args.kjv)
    os.makedirs(args.out, exist_ok=True)
    for name, part in (("kjv.txt", lines), ("ot.txt", lines[:KJV_OT_VERSES]), ("nt.txt", lines[KJV_OT_VERSES:])):
        with open(os.path.join(args.out, name), "w") as f:
            f.write("\n".join(part) + "\n")
        print(f"wrote {os.path.join(args.out, name)}: {len(part)} verses, {sum(len(x) + 1 for x in part)} bytes")


# ---- fine-tuning a trained base ----------------------------------------------------------------------------------
def cmd_finetune(args):
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        fail(f"--methods: {', '.join(bad)} unknown (known: {', '.join(METHODS)})")
    if "full" not in methods:
        fail("--methods needs 'full': the other methods are measured as a share of its improvement")
    methods = ["full"] + [m for m in methods if m != "full"]
    known = strategies_of(args.binary)
    missing = [METHODS[m] for m in methods if METHODS[m] not in known]
    if missing:
        fail(f"this llama_train has no strategy {', '.join(missing)} ({', '.join(known)})")
    for c in (args.base_corpus, args.ft_corpus):
        if not os.path.exists(c):
            fail(f"corpus {c} does not exist (fidelity.py corpora writes ot.txt and nt.txt)")
    seeds = int_list(args.seeds)
    tps = args.batch * args.seq
    base_steps = args.base_steps or -(-args.base_tokens // tps)
    steps = args.steps or -(-args.tokens // tps)
    runner = Runner(args.binary, args.work, args.runs, args.budget_s, args.quiet)
    common = ["--batch", args.batch, "--seq", args.seq, "--eval-batches", args.eval_batches, "--eval-every", 0, "--sample", 0,
              "--device", args.device] + (["--threads", args.threads] if args.threads else [])

    # 1. The base: bf16 on the first corpus, exported as a Hugging Face directory. A record whose directory is gone
    # (another machine) is trained again, and what depends on it gets the new run's id.
    base_cfg = {"kind": "ft-base", "preset": args.preset, "strategy": "bf16", "seed": args.base_seed, "steps": base_steps,
                "batch": args.batch, "seq": args.seq, "lr": args.base_lr, "eval_batches": args.eval_batches, "device": args.device,
                "corpus": corpus_name(args.base_corpus)}
    base_dir = os.path.join(args.work, "base-" + runner.slug(base_cfg).rsplit("-", 1)[1])
    if not os.path.exists(os.path.join(base_dir, "config.json")):
        runner.done.pop(config_key(base_cfg), None)
    runner.say(f"finetune: base {args.preset} bf16 {base_steps} steps on {corpus_name(args.base_corpus)}, then {', '.join(methods)} "
               f"{steps} steps on {corpus_name(args.ft_corpus)} ({steps * tps} tokens each), seeds {args.seeds}")
    base = runner.run(base_cfg, ["--preset", args.preset, "--strategy", "bf16", "--seed", args.base_seed, "--steps", base_steps,
                                 "--lr", args.base_lr, "--corpus", args.base_corpus, "--export-hf", base_dir] + common)
    if base is None:
        runner.report()
        return 1
    # A base trained again from the same configuration that evaluates the same is the first one: its runs are kept.
    base_id = same_bases(read_jsonl(args.runs), base)[0]["run_id"]
    if args.base_path:
        with open(args.base_path, "w") as f:
            f.write(os.path.abspath(base_dir) + "\n")

    def ft_cfg(kind, method, seed, n):  # a steps-0 evaluation does not depend on the rate: lr None, run once
        lr = None if n == 0 else args.full_lr if method == "full" else args.lora_lr
        return {"kind": kind, "base": base_id, "method": method, "strategy": METHODS[method], "seed": seed, "steps": n, "batch": args.batch,
                "seq": args.seq, "lr": lr, "eval_batches": args.eval_batches, "device": args.device, "corpus": corpus_name(args.ft_corpus)}

    def ft_args(method, seed, n):
        lr = args.full_lr if method == "full" else args.lora_lr
        return ["--hf", base_dir, "--strategy", METHODS[method], "--seed", seed, "--steps", n, "--lr", lr, "--corpus", args.ft_corpus] + common

    # 2. Each method before training (steps 0: the base as that method holds it, e.g. quantized), then per seed.
    for method in methods:
        runner.run(ft_cfg("ft-start", method, args.base_seed, 0), ft_args(method, args.base_seed, 0))
        for seed in seeds:
            runner.run(ft_cfg("ft", method, seed, steps), ft_args(method, seed, steps))
    runner.report()
    lines = summarize_finetune(read_jsonl(args.runs), base_id)
    if args.out:
        write_jsonl(args.out, lines)
        print_finetune(lines)
    return 1 if runner.failed else 0


def same_bases(records, base):
    """The base records among `records` that are `base` (itself included): trained from the same configuration, they
    evaluate the same (a base trained again on a new machine), in file order."""
    return [b for b in records if b.get("config", {}).get("kind") == "ft-base"
            and b["config"] == base["config"] and b["result"]["val_ppl"] == base["result"]["val_ppl"]]


def summarize_finetune(records, base_id=None):
    """One line per fine-tuning method, learning rate and length on the base `base_id` (default: the newest base in
    the records). Each is measured against full fine-tuning of the same length; of several full fine-tuning rates,
    the best (lowest mean perplexity) is the reference."""
    bases = [r for r in records if r.get("config", {}).get("kind") == "ft-base"]
    if not bases:
        return []
    base = next((b for b in bases if b["run_id"] == base_id), None) if base_id else bases[-1]
    if base is None:
        return []
    # A base trained again from the same configuration (a new machine) is the same base when it evaluates the same:
    # the runs on either are pooled.
    same = {b["run_id"] for b in same_bases(bases, base)}
    start, runs = {}, {}  # method -> its steps-0 record; (method, lr, steps) -> seed -> record (the latest wins)
    for r in records:
        c = r.get("config", {})
        if c.get("base") not in same:
            continue
        if c["kind"] == "ft-start":
            start[c["method"]] = r
        elif c["kind"] == "ft":
            runs.setdefault((c["method"], c["lr"], c["steps"]), {})[c["seed"]] = r
    # The base's perplexity on the second corpus is full fine-tuning's starting point (bf16, before any step).
    base_start = start.get("full")
    base_ppl = base_start["result"]["val_ppl"] if base_start else None
    stats = {}
    for key, seeds in runs.items():
        ppl = [seeds[s]["result"]["val_ppl"] for s in sorted(seeds)]
        if all(p is not None for p in ppl):
            stats[key] = (mean(ppl), sample_std(ppl), ppl)
    full = {}  # steps -> the best full fine-tuning's (mean, lr)
    for (method, lr, steps), st in stats.items():
        if method == "full" and (steps not in full or st[0] < full[steps][0]):
            full[steps] = (st[0], lr)
    rank = {m: i for i, m in enumerate(METHODS)}
    lines = []
    for key in sorted(runs, key=lambda k: (k[2], rank.get(k[0], len(rank)), k[0], k[1])):
        method, lr, steps = key
        seeds = runs[key]
        recs = [seeds[s] for s in sorted(seeds)]
        results = [r["result"] for r in recs]
        tokens = sorted({r["tokens"] for r in results})
        line = {"bench": "finetune", "case": f"{method} {base['config']['preset']} lr {lr:g}", "peer": "full", "method": method,
                "strategy": recs[0]["config"]["strategy"], "preset": base["config"]["preset"],
                "tokens": tokens[0] if len(tokens) == 1 else tokens, "seeds": sorted(seeds), "lr": lr,
                "base_tokens": base["result"]["tokens"], "base_corpus": base["config"]["corpus"], "corpus": recs[0]["config"]["corpus"],
                "base_val_ppl": base["result"]["val_ppl"], "base_ppl": base_ppl,
                "start_ppl": start[method]["result"]["val_ppl"] if method in start else None,
                "device": device_of(recs + [base]), "train_device": base["config"]["device"],
                "commit": ",".join(sorted({r["commit"] for r in recs + [base]})), "date": max(r["date"] for r in recs)}
        if key not in stats:
            line.update({"ppl_mean": None, "ppl_std": None, "improvement": None, "share_of_full": None, "within_target": False,
                         "note": "a seed ended without a finite perplexity"})
            lines.append(line)
            continue
        m, s, ppl = stats[key]
        ref = full.get(steps)
        line.update({"ppl_mean": m, "ppl_std": s, "ppl_per_seed": ppl, "full_lr": ref[1] if ref else None})
        line["improvement"] = None if base_ppl is None else base_ppl - m
        if base_ppl is not None and ref is not None and base_ppl - ref[0] > 0:
            line["share_of_full"] = (base_ppl - m) / (base_ppl - ref[0])
            # The same share on the loss scale (nats per byte), which perplexity's exponential does not bend.
            line["share_of_full_loss"] = (math.log(base_ppl) - math.log(m)) / (math.log(base_ppl) - math.log(ref[0]))
        else:
            line["share_of_full"] = line["share_of_full_loss"] = None
            line["note"] = ("full fine-tuning did not improve on the base" if ref is not None and base_ppl is not None
                            else "no full fine-tuning of this length or no base evaluation yet")
        if method != "full":
            line["share_target"] = SHARE_TARGET
            line["within_target"] = line["share_of_full"] is not None and line["share_of_full"] >= SHARE_TARGET
        line.update(speed_of(recs))
        lines.append(line)
    return lines


def print_finetune(lines):
    for ln in lines:
        if ln.get("bench") != "finetune":
            continue
        print(f"{ln['preset']:>14} {ln['method']:<12} lr {ln['lr']:<7g} {len(ln['seeds'])} seeds  base {fmt(ln['base_ppl'])} -> {fmt(ln['ppl_mean'])} ± "
              f"{fmt(ln['ppl_std'])} (start {fmt(ln['start_ppl'])})  share of full {fmt(ln['share_of_full'], '.3f')}"
              + ("" if ln["method"] == "full" else f"  {'meets' if ln.get('within_target') else 'below'} {SHARE_TARGET:.0%}"))


# ---- self-check: a miniature of both harnesses, verified independently --------------------------------------------
class Checks:
    def __init__(self):
        self.n = 0

    def ok(self, cond, what):
        if not cond:
            raise SystemExit("selfcheck FAILED: " + what)
        self.n += 1


def close(a, b, rel=1e-12):
    return a is not None and b is not None and abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def printed_ppl(log_path):
    """The perplexity llama_train printed in its last line of results (its own text, not --result-json)."""
    m = re.findall(r"validation perplexity ([0-9.]+)", open(log_path).read())
    return float(m[-1]) if m else None


def cmd_selfcheck(args):
    import statistics  # the independent computation the driver's own mean / std are checked against

    work = os.path.abspath(args.work)
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    ck = Checks()
    known = strategies_of(args.binary)
    ck.ok(len(known) >= 3 and known[0] == "fp32", f"--help lists the strategies with fp32 first: {known}")
    strategies = args.strategies.split(",")
    ck.ok(all(s in known for s in strategies), f"{strategies} are all compiled in ({known})")
    seeds = int_list(args.seeds)
    runs = os.path.join(work, "runs.jsonl")
    base = [sys.executable, os.path.abspath(__file__)]
    common = ["--binary", args.binary, "--preset", "tiny", "--device", "cpu", "--steps", str(args.steps), "--batch", "4", "--seq", "32",
              "--eval-batches", "1", "--threads", "1", "--corpus", args.corpus, "--seeds", args.seeds, "--runs", runs,
              "--work", os.path.join(work, "w"), "--quiet"]

    # 1. Two calls with different strategy subsets append to one runs file; a third repeats the first and runs nothing.
    def call(extra):
        p = subprocess.run(base + ["run"] + common + extra, capture_output=True, text=True)
        ck.ok(p.returncode == 0, f"fidelity.py run {' '.join(extra)} exited {p.returncode}: {p.stdout[-800:]} {p.stderr[-800:]}")
        return p.stdout

    call(["--strategies", ",".join(strategies[:-1])])
    n_first = len(read_jsonl(runs))
    ck.ok(n_first == (len(strategies) - 1) * len(seeds), f"the first call recorded {n_first} runs")
    bad = subprocess.run(base + ["run"] + common + ["--jobs", "0"], capture_output=True, text=True)
    ck.ok(bad.returncode != 0 and "--jobs 0" in bad.stderr + bad.stdout, "--jobs 0 is refused by name: " + (bad.stderr + bad.stdout)[-300:])
    call(["--strategies", strategies[-1], "--jobs", "2"])  # its seeds at once, as on the GPU
    out = call(["--strategies", ",".join(strategies[:-1])])
    recs = read_jsonl(runs)
    ck.ok(len(recs) == len(strategies) * len(seeds), f"{len(recs)} runs recorded after the second call")
    ck.ok(sorted(r["config"]["seed"] for r in recs if r["config"]["strategy"] == strategies[-1]) == sorted(seeds),
          "the runs made two at a time are each seed once")
    ck.ok(all(r["concurrent_runs"] == (2 if r["config"]["strategy"] == strategies[-1] else 1) for r in recs),
          "each run records how many shared the device: " + str([r.get("concurrent_runs") for r in recs]))
    ck.ok("0 run(s) this call" in out, "repeating a call runs nothing again: " + out[-300:])

    # 2. The binary's own result files (not the runs file the driver wrote), against its printed line.
    results = {}
    for rec in recs:
        c = rec["config"]
        path = os.path.join(work, "w", "results", os.path.basename(rec["log"])[:-4] + ".json")
        with open(path) as f:
            r = json.load(f)
        results[(c["strategy"], c["seed"])] = r
        for field in ("strategy", "preset", "steps", "tokens", "seed", "val_loss", "val_ppl", "train_loss", "tokens_per_s", "peak_gb"):
            ck.ok(field in r, f"{path} has '{field}'")
        ck.ok(r["strategy"] == c["strategy"] and r["seed"] == c["seed"], f"{path} is the run of {c['strategy']} seed {c['seed']}")
        ck.ok(r["tokens"] == args.steps * 4 * 32, f"{path}: {r['tokens']} tokens, expected {args.steps} x 4 x 32")
        ck.ok(close(r["val_ppl"], math.exp(r["val_loss"]), 1e-9), f"{path}: val_ppl {r['val_ppl']} is exp(val_loss {r['val_loss']})")
        shown = printed_ppl(os.path.join(work, "w", "logs", rec["log"]))
        ck.ok(shown is not None and abs(shown - r["val_ppl"]) <= 0.0005 + 1e-9, f"{rec['log']}: printed perplexity {shown}, JSON {r['val_ppl']}")
    ck.ok(len({r["tokens"] for r in results.values()}) == 1, "every strategy trained on the same number of tokens")

    # 3. The same run again (one CPU thread) gives the same perplexity: the seed spread is the seeds', not noise.
    again = os.path.join(work, "again.json")
    subprocess.run([args.binary, "--preset", "tiny", "--strategy", strategies[0], "--seed", str(seeds[0]), "--steps", str(args.steps),
                    "--batch", "4", "--seq", "32", "--eval-batches", "1", "--eval-every", "0", "--sample", "0", "--threads", "1",
                    "--corpus", args.corpus, "--result-json", again], capture_output=True, check=True)
    ck.ok(json.load(open(again))["val_ppl"] == results[(strategies[0], seeds[0])]["val_ppl"], "a repeated run gives the same perplexity")

    # 4. The summary against statistics' mean / stdev of those files.
    fid = os.path.join(work, "fidelity.jsonl")
    p = subprocess.run(base + ["summarize", "--runs", runs, "--out", fid], capture_output=True, text=True)
    ck.ok(p.returncode == 0, "fidelity.py summarize: " + p.stderr[-500:])
    lines = read_jsonl(fid)
    ck.ok(sorted(ln["strategy"] for ln in lines) == sorted(strategies), f"one summary line per strategy: {[ln['strategy'] for ln in lines]}")
    ref = [results[("fp32", s)]["val_ppl"] for s in seeds]
    ref_m, ref_s = statistics.mean(ref), statistics.stdev(ref)
    ck.ok(ref_s > 0, "different seeds give different perplexities")
    for ln in lines:
        for field in FIDELITY_FIELDS:
            ck.ok(field in ln, f"summary line of {ln.get('strategy')} has '{field}'")
        ppl = [results[(ln["strategy"], s)]["val_ppl"] for s in seeds]
        m, s = statistics.mean(ppl), statistics.stdev(ppl)
        ck.ok(ln["seeds"] == seeds, f"{ln['strategy']}: seeds {ln['seeds']}")
        ck.ok(ln["tokens"] == args.steps * 4 * 32 and ln["preset"] == "tiny", f"{ln['strategy']}: tokens {ln['tokens']}, preset {ln['preset']}")
        ck.ok(close(ln["ppl_mean"], m), f"{ln['strategy']}: ppl_mean {ln['ppl_mean']} != statistics.mean {m}")
        ck.ok(close(ln["ppl_std"], s, 1e-9), f"{ln['strategy']}: ppl_std {ln['ppl_std']} != statistics.stdev {s}")
        ck.ok(close(ln["ratio_vs_fp32"], m / ref_m, 1e-12), f"{ln['strategy']}: ratio {ln['ratio_vs_fp32']} != {m / ref_m}")
        shared = ln["strategy"] == strategies[-1]  # its seeds ran two at a time: no speed of its own
        speed = None if shared else statistics.mean(results[(ln["strategy"], x)]["tokens_per_s"] for x in seeds)
        ck.ok(ln["concurrent_runs"] == [2 if shared else 1] and (ln["tokens_per_s_mean"] is None if shared else close(ln["tokens_per_s_mean"], speed)),
              f"{ln['strategy']}: tokens_per_s_mean {ln['tokens_per_s_mean']} from the runs alone ({speed}), concurrent_runs {ln['concurrent_runs']}")
        expect = abs(m - ref_m) <= 0.01 * ref_m or abs(m - ref_m) <= 2 * math.sqrt((s * s + ref_s * ref_s) / 2)
        ck.ok(ln["within_target"] is expect, f"{ln['strategy']}: within_target {ln['within_target']}, expected {expect}")
        ck.ok(isinstance(ln["commit"], str) and ln["commit"] and re.match(r"\d{4}-\d\d-\d\dT", ln["date"]), f"{ln['strategy']}: commit and date")
    ck.ok(next(ln for ln in lines if ln["strategy"] == "fp32")["ratio_vs_fp32"] == 1.0, "fp32's ratio to itself is 1")

    # 5. Fine-tuning in miniature: a base on the first half of the corpus, every method on the second half.
    with open(args.corpus) as f:
        text = f.read().splitlines()
    half = len(text) // 2
    for name, part in (("a.txt", text[:half]), ("b.txt", text[half:])):
        with open(os.path.join(work, name), "w") as f:
            f.write("\n".join(part) + "\n")
    ft_runs, ft_out, base_seed = os.path.join(work, "ft-runs.jsonl"), os.path.join(work, "finetune.jsonl"), 7
    p = subprocess.run(base + ["finetune", "--binary", args.binary, "--preset", "tiny", "--device", "cpu", "--base-steps", str(2 * args.steps),
                               "--steps", str(args.steps), "--batch", "4", "--seq", "32", "--eval-batches", "1", "--threads", "1",
                               "--base-corpus", os.path.join(work, "a.txt"), "--ft-corpus", os.path.join(work, "b.txt"), "--seeds", args.seeds,
                               "--base-seed", str(base_seed), "--base-lr", "3e-3", "--full-lr", "1e-3", "--lora-lr", "1e-2", "--runs", ft_runs, "--work", os.path.join(work, "ft"),
                               "--out", ft_out, "--base-path", os.path.join(work, "base.path"), "--quiet"], capture_output=True, text=True)
    ck.ok(p.returncode == 0, f"fidelity.py finetune exited {p.returncode}: {p.stdout[-800:]} {p.stderr[-800:]}")
    base_path = open(os.path.join(work, "base.path")).read().strip()
    ck.ok(os.path.isfile(os.path.join(base_path, "config.json")) and os.path.dirname(base_path) == os.path.join(work, "ft"),
          f"--base-path names the exported base: {base_path}")
    ft = {ln["method"]: ln for ln in read_jsonl(ft_out)}
    ck.ok(sorted(ft) == sorted(METHODS), f"one fine-tuning line per method: {sorted(ft)}")
    ft_recs = read_jsonl(ft_runs)
    own = {}
    for rec in ft_recs:
        c = rec["config"]
        with open(os.path.join(work, "ft", "results", rec["log"][:-4] + ".json")) as f:
            own[(c["kind"], c.get("method"), c["seed"])] = json.load(f)
    base_eval = own[("ft-start", "full", base_seed)]
    ck.ok(base_eval["steps"] == 0 and base_eval["tokens"] == 0 and base_eval["hf"], "the base's evaluation on the second corpus trained nothing")
    base_ppl = base_eval["val_ppl"]
    full = statistics.mean(own[("ft", "full", s)]["val_ppl"] for s in seeds)
    for method, ln in ft.items():
        for field in FINETUNE_FIELDS:
            ck.ok(field in ln, f"fine-tuning line of {method} has '{field}'")
        ppl = [own[("ft", method, s)]["val_ppl"] for s in seeds]
        ck.ok(all(own[("ft", method, s)]["tokens"] == args.steps * 4 * 32 for s in seeds), f"{method}: every seed trained {args.steps} x 4 x 32 tokens")
        ck.ok(own[("ft", method, seeds[0])]["lora"] == (method != "full"), f"{method}: trains {'adapters' if method != 'full' else 'every weight'}")
        ck.ok(close(ln["ppl_mean"], statistics.mean(ppl)) and close(ln["ppl_std"], statistics.stdev(ppl), 1e-9), f"{method}: mean / std")
        ck.ok(close(ln["base_ppl"], base_ppl), f"{method}: base perplexity {ln['base_ppl']} != {base_ppl}")
        ck.ok(close(ln["start_ppl"], own[("ft-start", method, base_seed)]["val_ppl"]), f"{method}: its perplexity before training")
        if base_ppl > full:
            ck.ok(close(ln["share_of_full"], (base_ppl - statistics.mean(ppl)) / (base_ppl - full), 1e-9), f"{method}: share {ln['share_of_full']}")
        else:
            ck.ok(ln["share_of_full"] is None, f"{method}: no share without an improvement by full fine-tuning")
    ck.ok(close(ft["lora"]["start_ppl"], ft["full"]["start_ppl"], 1e-3), "LoRA's adapters start at zero: the dense base's perplexity")
    print(f"selfcheck: {ck.n} checks passed ({len(recs)} fidelity runs, {len(ft_recs)} fine-tuning runs)")
    return 0


def cmd_selftest(_args):
    """The statistics and the summaries on fixed numbers, without llama_train."""
    ck = Checks()
    ck.ok(mean([2, 4, 4, 4, 5, 5, 7, 9]) == 5.0, "mean")
    ck.ok(close(sample_std([2, 4, 4, 4, 5, 5, 7, 9]), math.sqrt(32 / 7)), "sample standard deviation (n - 1)")
    ck.ok(sample_std([3.0]) is None, "no standard deviation of one value")
    ck.ok(within_target(10.09, 0.0, 10.0, 0.0) and not within_target(10.2, 0.01, 10.0, 0.01), "the 1% rule")
    ck.ok(within_target(10.5, 0.3, 10.0, 0.2) and not within_target(10.5, 0.1, 10.0, 0.1), "the two-standard-deviation rule")
    names = parse_strategies("  --strategy TEXT:{fp32,accum4,bf16} [fp32]  memory strategy\n", "help")
    ck.ok(names == ["fp32", "accum4", "bf16"], f"strategy names from --help: {names}")

    def rec(strategy, seed, ppl, tokens=1000):
        return {"config": {"kind": "pretrain", "preset": "p", "strategy": strategy, "seed": seed, "steps": 10, "batch": 10, "seq": 10,
                           "lr": None, "eval_batches": 1, "device": "cpu", "corpus": "c", "extra": ""},
                "result": {"val_ppl": ppl, "tokens": tokens, "tokens_per_s": 1.0, "peak_gb": 1.0, "lr": 1e-3},
                "commit": "abc", "date": "2026-01-01T00:00:00Z", "run_id": f"{strategy}{seed}"}

    lines = {ln["strategy"]: ln for ln in summarize([rec("fp32", 1, 4.0), rec("fp32", 2, 4.2), rec("x", 1, 4.4), rec("x", 2, 4.8)])}
    x = lines["x"]
    ck.ok(close(x["ppl_mean"], 4.6) and close(x["ppl_std"], math.sqrt(0.08)), f"summary mean / std: {x['ppl_mean']}, {x['ppl_std']}")
    ck.ok(close(x["ratio_vs_fp32"], 4.6 / 4.1) and close(x["ratio_paired_mean"], (1.1 + 4.8 / 4.2) / 2), "ratios")
    ck.ok(x["within_target"] is False and lines["fp32"]["within_target"] is True, "within_target")
    y = {ln["strategy"]: ln for ln in summarize([rec("fp32", 1, 4.0), rec("r", 1, 4.4), rec("r", 2, 4.0), rec("x", 1, 4.4), rec("x", 2, 4.8)], "r")}["x"]
    ck.ok(close(y["ratio_vs_reference"], 4.6 / 4.2) and close(y["ratio_paired_vs_reference_mean"], (1.0 + 1.2) / 2) and y["reference"] == "r",
          "ratios to a reference other than fp32")
    later = summarize([rec("fp32", 1, 4.0), rec("fp32", 1, 4.1)])  # a seed run twice: the later record counts
    ck.ok(later[0]["ppl_per_seed"] == [4.1] and later[0]["ppl_std"] is None, "the latest record of a seed wins")

    def ft(kind, method, seed, ppl, steps=5):
        return {"config": {"kind": kind, "base": "B", "method": method, "strategy": METHODS[method], "seed": seed, "steps": steps, "lr": 1e-3,
                           "corpus": "nt"}, "result": {"val_ppl": ppl, "tokens": steps * 10, "tokens_per_s": 1.0, "peak_gb": 1.0},
                "commit": "abc", "date": "2026-01-01T00:00:00Z", "run_id": "r"}
    base = {"config": {"kind": "ft-base", "preset": "p", "corpus": "ot", "device": "cpu"}, "result": {"val_ppl": 3.0, "tokens": 100},
            "commit": "abc", "date": "2026-01-01T00:00:00Z", "run_id": "B"}
    f = {ln["method"]: ln for ln in summarize_finetune([base, ft("ft-start", "full", 1, 10.0, 0), ft("ft", "full", 1, 6.0), ft("ft", "full", 2, 6.2),
                                                         ft("ft-start", "qlora", 1, 10.5, 0), ft("ft", "qlora", 1, 6.2), ft("ft", "qlora", 2, 6.4)])}
    ck.ok(close(f["full"]["share_of_full"], 1.0) and close(f["qlora"]["share_of_full"], 3.7 / 3.9), "share of full fine-tuning's improvement")
    ck.ok(f["qlora"]["within_target"] is True and f["qlora"]["start_ppl"] == 10.5 and f["qlora"]["base_ppl"] == 10.0, "fine-tuning target and start")
    # A second full fine-tuning rate that does better becomes the reference; each rate keeps its own line.
    sweep = [base, ft("ft-start", "full", 1, 10.0, 0), ft("ft", "full", 1, 6.0), ft("ft", "qlora", 1, 6.5)]
    faster = ft("ft", "full", 1, 5.0)
    faster["config"]["lr"] = 1e-2
    g = summarize_finetune(sweep + [faster])
    ck.ok([(ln["method"], ln["lr"]) for ln in g] == [("full", 1e-3), ("full", 1e-2), ("qlora", 1e-3)], f"one line per rate: {g}")
    ck.ok(close(g[2]["share_of_full"], 3.5 / 5.0) and g[2]["full_lr"] == 1e-2 and close(g[0]["share_of_full"], 0.8), "the best full rate is the reference")
    # The same base trained again (a new run id, the same configuration and perplexity) pools its runs with the first;
    # one that evaluates differently is another base.
    again = dict(base, run_id="B2")
    on_again = ft("ft", "lora", 1, 6.1)
    on_again["config"]["base"] = "B2"
    h = {ln["method"]: ln for ln in summarize_finetune(sweep + [again, on_again])}
    ck.ok(sorted(h) == ["full", "lora", "qlora"] and close(h["lora"]["share_of_full"], 3.9 / 4.0), f"a retrained base pools: {sorted(h)}")
    firsts = [b["run_id"] for b in same_bases(sweep + [again], again)]
    ck.ok(firsts[0] == base["run_id"] and firsts[-1] == "B2", f"a retrained base fine-tunes as the first one, so its runs are kept: {firsts}")
    other = dict(base, run_id="B3", result={"val_ppl": 3.1, "tokens": 100})
    on_other = ft("ft", "lora", 1, 6.1)
    on_other["config"]["base"] = "B3"
    k = summarize_finetune(sweep + [on_other, other])  # the newest base, B3: only its own run, no full reference
    ck.ok([ln["method"] for ln in k] == ["lora"] and k[0]["share_of_full"] is None, f"a base that evaluates differently is not pooled: {k}")
    print(f"selftest: {ck.n} checks passed")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def geometry(p):
        p.add_argument("--binary", required=True, help="llama_train")
        p.add_argument("--preset", default="125m", help="llama_train --preset (default 125m)")
        p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
        p.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
        p.add_argument("--seq", type=int, default=256, help="bytes per sequence (default 256)")
        p.add_argument("--eval-batches", type=int, default=16, help="validation batches at the end (default 16)")
        p.add_argument("--threads", type=int, default=0, help="llama_train --threads (0: its default)")
        p.add_argument("--runs", required=True, help="JSON lines of the runs: read (runs already there are skipped) and appended")
        p.add_argument("--work", required=True, help="folder for result files, logs and (finetune) the exported base")
        p.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds; stop one still running then")
        p.add_argument("--quiet", action="store_true")

    p = sub.add_parser("run", help="each strategy x seed at equal tokens")
    geometry(p)
    p.add_argument("--strategies", default="all", help="comma-separated names, or 'all' (llama_train --help's list)")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run")
    p.add_argument("--tokens", type=int, default=0, help="tokens per run instead of --steps (rounded up to whole steps)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: llama_train's for the preset)")
    p.add_argument("--corpus", default="", help="llama_train --corpus (default: its KJV)")
    p.add_argument("--extra-args", default="", help="more llama_train arguments, the same for every run (part of the run's identity)")
    p.add_argument("--ckpt-root", default="", help="checkpoint each run here every --save-every steps; a run stopped at the budget "
                                                   "resumes from it in a later call on the same machine")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--keep-checkpoints", action="store_true", help="keep a finished run's checkpoints")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time on the one device (default 1; their tokens/s is then shared)")
    p.add_argument("--out", default="", help="also write the summary here")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("summarize", help="runs -> one line per strategy (and per fine-tuning method)")
    p.add_argument("--runs", nargs="+", required=True)
    p.add_argument("--reference", default="fp32", help="also give each strategy's ratios to this one (default: fp32 only)")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_summarize)

    p = sub.add_parser("corpora", help="the KJV, its Old Testament (a base's corpus) and New Testament (the held-out one)")
    p.add_argument("--kjv", default="", help="the KJV one verse per line (default: from the `bible` program)")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_corpora)

    p = sub.add_parser("finetune", help="a bf16 base, then full / LoRA / QLoRA / GPTQ-4 + LoRA fine-tuning on a second corpus")
    geometry(p)
    p.add_argument("--base-corpus", required=True, help="the base's training text (corpora's ot.txt)")
    p.add_argument("--ft-corpus", required=True, help="the fine-tuning text (corpora's nt.txt); its last 5%% of lines are the validation text")
    p.add_argument("--base-steps", type=int, default=0)
    p.add_argument("--base-tokens", type=int, default=10_000_000, help="the base's tokens when --base-steps is not given")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--tokens", type=int, default=2_457_600, help="each fine-tuning run's tokens when --steps is not given")
    p.add_argument("--base-seed", type=int, default=1337)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--base-lr", type=float, default=1e-3)
    p.add_argument("--full-lr", type=float, default=3e-4, help="full fine-tuning's peak learning rate")
    p.add_argument("--lora-lr", type=float, default=3e-3, help="the LoRA methods' peak learning rate (adapters only)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--base-path", default="", help="write the exported base's directory into this file (for bench_table --hf)")
    p.add_argument("--out", default="")
    p.set_defaults(fn=cmd_finetune)

    p = sub.add_parser("selfcheck", help="a CPU miniature of both harnesses, its statistics checked independently")
    p.add_argument("--binary", required=True)
    p.add_argument("--corpus", required=True, help="a small text (tests/fixtures/text/genesis-1-3.txt)")
    p.add_argument("--work", required=True)
    p.add_argument("--strategies", default="fp32,bf16,fp16")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--steps", type=int, default=3)
    p.set_defaults(fn=cmd_selfcheck)

    p = sub.add_parser("selftest", help="the statistics on fixed numbers (no llama_train)")
    p.set_defaults(fn=cmd_selftest)

    args = ap.parse_args()
    sys.exit(args.fn(args))


if __name__ == "__main__":
    main()
