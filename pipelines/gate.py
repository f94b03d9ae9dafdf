"""The gate of continual pretraining: a candidate drafter replaces the committed one only when it is
accepted more often on every held-out domain.

`adaflash pretrain --stage gate` evaluates the current drafter (`gate.current`, the committed
models/drafter-smollm2) and the candidate (the run's export, `drafter_out`) in one eval run: the same
held-out eval prompts of every domain in `eval.domains`, plain decoding and both drafters back to back
per prompt, one chain verifying the whole block (what `adaflash generate --tree 0 --lookup 0` runs),
greedy output checked token for token against plain decoding. `decide` turns the two tau tables into
the verdict (a pure function of them); on a pass the candidate's safetensors + JSON files are written
beside the destination and renamed into place (`install_drafter`). gate.md and gate.json in the run
directory hold the before/after table either way.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from adaflash.pipelines.evaluate import EvalSection, evaluate

from adaflash.drafter import CONFIG, WEIGHTS
from adaflash.length_head import META as HEAD_META
from adaflash.registry import DOWNLOAD_SUFFIXES


@dataclass
class GateSection:
    current: str = "models/drafter-smollm2"  # the drafter the candidate must beat, and replaces when it does
    out: str | None = None  # where a passing candidate is written; None = over `current` (a trial run names another folder)


def decide(current: dict[str, float], candidate: dict[str, float]) -> tuple[bool, list[str]]:
    """Tau per domain of the current and the candidate drafter -> (replace, one line per domain).
    Replace only when the candidate's tau is higher on every domain; a tie is not a win."""
    if not current or set(current) != set(candidate):
        raise ValueError(f"the tau tables must name the same domains, got {sorted(current)} and {sorted(candidate)}")
    lines = [
        f"{d}: tau {current[d]:.3f} -> {candidate[d]:.3f} ({'better' if candidate[d] > current[d] else 'not better'})" for d in current
    ]
    return all(candidate[d] > current[d] for d in current), lines


def install_drafter(src: Path, dest: Path, extra: dict[str, str] | None = None) -> Path:
    """Copy drafter directory `src`'s safetensors + JSON files (what the loaders read; the registry downloads
    the same) plus `extra` {file name: text} to `dest`. They are written into a hidden folder beside `dest`,
    then renamed into place; an existing `dest` is renamed aside just before and removed after, so a reader
    finds the old directory or the new one whole, never a mix."""
    src, dest = Path(src), Path(dest)
    files = [f for f in sorted(src.iterdir()) if f.is_file() and f.name.endswith(DOWNLOAD_SUFFIXES)] if src.is_dir() else []
    if not {CONFIG, WEIGHTS} <= {f.name for f in files}:
        raise FileNotFoundError(f"{src} is not a drafter directory (needs {CONFIG} and {WEIGHTS})")
    dest.parent.mkdir(parents=True, exist_ok=True)
    new, old = dest.parent / f".{dest.name}.new-{os.getpid()}", dest.parent / f".{dest.name}.old-{os.getpid()}"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    for f in files:
        shutil.copy2(f, new / f.name)
    for name, text in (extra or {}).items():
        (new / name).write_text(text)
    if dest.exists():
        os.rename(dest, old)
    os.rename(new, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def gate_table(result: dict) -> str:
    """The before/after table of a gate run, with the verdict."""
    lines = [
        f"Gate: candidate `{result['candidate']}` vs current `{result['current']}`, {result['time']}. Chain tau: one "
        f"{result['verify_len']}-token block verified per round, no tree, no lookup (`adaflash generate --tree 0 --lookup 0`); "
        f"the first {result['per_domain']} held-out eval prompts per domain, {result['max_new_tokens']} new tokens, greedy.",
        "",
        "| domain | prompts | tau current | tau candidate | change | identical greedy current / candidate | speedup current / candidate |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, r in result["domains"].items():
        cur, cand = r["current"], r["candidate"]
        lines.append(
            f"| {d} | {r['prompts']} | {cur['tau']:.2f} | {cand['tau']:.2f} | {cand['tau'] - cur['tau']:+.2f} | "
            f"{cur['identical_greedy']}/{r['prompts']} / {cand['identical_greedy']}/{r['prompts']} | "
            f"{cur['speedup']:.2f}x / {cand['speedup']:.2f}x |"
        )
    return "\n".join(lines + ["", result["verdict"], ""])


def run_gate(
    gate: GateSection,
    ev: EvalSection,
    candidate_dir: str | Path,
    prompts_dir: Path,
    run_dir: Path,
    target_source: str = "smollm2",
    dtype: str = "float32",
) -> dict:
    """Evaluate `gate.current` and the candidate in one run, write run_dir/gate.md + gate.json, and install
    the candidate at `gate.out` (default: over `gate.current`) only when `decide` says so. -> the result."""
    from adaflash.pipelines.prompts import available_domains, build_prompt_sets, read_prompts

    from adaflash.drafter import load_drafter
    from adaflash.target import load_target

    current, candidate = Path(gate.current), Path(candidate_dir)
    if current.resolve() == candidate.resolve():
        raise ValueError(f"drafter_out is gate.current ({current}): export the candidate elsewhere so the gate can compare the two")
    if not (candidate / CONFIG).exists():
        raise FileNotFoundError(f"no candidate drafter in {candidate}: run the 'export' stage first")
    split = Path(prompts_dir) / "eval.parquet"
    if not split.exists():
        build_prompt_sets(Path(prompts_dir), available_domains())
    records = read_prompts(split, ev.domains, ev.per_domain)
    missing = [d for d in ev.domains if not any(r.domain == d for r in records)]
    if missing:
        raise ValueError(f"eval.domains {missing} have no held-out eval prompts (a train-only domain such as code): drop them")
    target = load_target(target_source, dtype)
    drafters = {
        name: load_drafter(path, target.model, target.identity, ev.drafter_dtype)
        for name, path in (("current", current), ("candidate", candidate))
    }
    sizes = {d.block_size for d in drafters.values()}
    if len(sizes) > 1:
        raise ValueError(f"the two drafters' block sizes differ {sorted(sizes)}: their chain tau is not comparable")
    k = sizes.pop()
    report = evaluate(target, drafters, records, ev.max_new_tokens, [k])  # one chain of the whole block each
    domains = {
        d: {"prompts": r["prompts"], **{n: r["variants"][f"{n}/dflash-v{k}"] for n in drafters}} for d, r in report["domains"].items()
    }
    tau = {n: {d: r[n]["tau"] for d, r in domains.items()} for n in drafters}
    replace, lines = decide(tau["current"], tau["candidate"])
    lossy = {f"{n} {d}": r[n]["mismatched_prompts"] for d, r in domains.items() for n in drafters if r[n]["mismatched_prompts"]}
    dest = Path(gate.out or gate.current)
    if lossy:
        replace, verdict = False, f"**Kept `{current}`: greedy output differed from plain decoding ({lossy}), a bug to fix first.**"
    elif replace:
        verdict = f"**The candidate's tau is higher on every domain: it is now `{dest}`.**"
    else:
        verdict = f"**Kept `{current}`: the candidate's tau is not higher on every domain** ({'; '.join(lines)})."
    if replace and (current / HEAD_META).exists():
        verdict += f" `{current}`'s length head was fit to its old weights and is not carried over: `adaflash fit-head --drafter {dest}`."
    result = {
        "current": str(current),
        "candidate": str(candidate),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "verify_len": k,
        "per_domain": ev.per_domain,
        "max_new_tokens": ev.max_new_tokens,
        "domains": domains,
        "decision": lines,
        "replace": replace,
        "installed": str(dest) if replace else None,
        "verdict": verdict,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "gate.md").write_text(gate_table(result))
    (run_dir / "gate.json").write_text(json.dumps({**result, "eval": report}, indent=2) + "\n")
    if replace:
        install_drafter(candidate, dest, {"gate.json": json.dumps(result, indent=2) + "\n"})
    print(gate_table(result), flush=True)
    if lossy:
        raise RuntimeError(f"greedy speculative output differed from plain decoding on {lossy}: see {run_dir / 'gate.md'}")
    return result
