"""Prompts the target writes itself ("Magpie"): sample a user turn from the chat template.

No chat corpus can be downloaded here, but an instruct model continues its own template: given the
text up to the start of a user turn (`<|im_start|>user\\n` for SmolLM2), it writes a plausible user
message and ends it with its end-of-turn token. A system line names a kind of request and a topic, so
the mix is spread over open-ended chat, writing, reasoning, science, math and code instead of
whatever the model writes most often unprompted.

`adaflash prompts magpie` samples in batches (one Parquet shard of raw turns per batch, resumable),
then filters every raw turn it holds (truncated, too short or long, not English, assistant-voiced or
refusing, near-duplicate of an earlier kept prompt) into `magpie.jsonl` (the prompt-set format:
one {"kind", "topic", "key", "text"} per line) and `report.json` / `report.md`
(the mix, why turns were dropped, distinct n-grams, topics covered). The prompt-set builder reads
that file as the `magpie_*` domains with a deterministic eval slice per kind (pipelines/prompts.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

TOPICS: dict[str, tuple[str, ...]] = {
    "chat": (
        "travel plans", "cooking at home", "personal finance", "fitness and health", "pets", "gardening",
        "movies and books", "career advice", "learning a language", "relationships", "hobbies", "home repair",
    ),
    "writing": (
        "a short story", "a poem", "an email to a colleague", "a product description", "a speech",
        "a cover letter", "a blog post", "a summary of an article", "a dialogue", "a persuasive essay",
    ),
    "reasoning": (
        "a logic puzzle", "planning a schedule", "comparing two options", "cause and effect", "a riddle",
        "ethics", "estimating quantities", "finding a flaw in an argument", "decision making", "strategy games",
    ),
    "science": (
        "physics", "chemistry", "biology", "astronomy", "geology", "climate and weather", "medicine",
        "ecology", "genetics", "electricity", "the human body", "oceans",
    ),
    "math": (
        "arithmetic word problems", "percentages", "algebra", "geometry", "probability", "statistics",
        "fractions", "sequences", "unit conversion", "number theory", "calculus", "money and interest",
    ),
    "code": (
        "Python functions", "sorting and searching", "string processing", "SQL queries", "JavaScript",
        "debugging an error", "data structures", "regular expressions", "file handling", "recursion",
        "object-oriented design", "shell scripts",
    ),
}  # fmt: skip
"""Kind -> topics named in the system line. Generic on purpose: nothing here is taken from an eval set."""

REQUEST: dict[str, str] = {
    "chat": "an everyday question or request",
    "writing": "a writing request",
    "reasoning": "a question that needs careful reasoning",
    "science": "a science question",
    "math": "a math problem",
    "code": "a programming question or task",
}

SYSTEM = "You are a helpful assistant. The user will send you {request} about {topic}."

RAW_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("topic", pa.string()),
        ("seed", pa.int64()),
        ("text", pa.string()),
        ("finished", pa.bool_()),  # ended with the end-of-turn token (else cut at max_new_tokens)
    ]
)

_ASSISTANT_VOICE = re.compile(
    r"^(sure|certainly|of course|absolutely|great question|here (is|are)|i'?m sorry|i cannot|i can'?t|as an ai|"
    r"hello!? how can i|hi!? how can i|thank you for)",
    re.IGNORECASE,
)
_REFUSAL = re.compile(r"\b(as an ai( language model)?|i'?m (just )?an ai|i am (just )?an ai|i cannot (help|assist))\b", re.I)
_WORD = re.compile(r"[a-z0-9']+")


def user_prefix(tokenizer, system: str) -> str:
    """The chat template's text up to where the user's message starts, for any template: render a
    conversation with a placeholder user message and cut at the placeholder."""
    mark = "\x00USER\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": mark}], tokenize=False, add_generation_prompt=False
    )
    return text[: text.index(mark)]


def plan(n: int) -> list[tuple[str, str]]:
    """The first n (kind, topic) jobs: kinds round-robin, each kind's topics in turn, so any prefix of
    the plan is balanced and a rerun with a larger n extends it."""
    out, kinds = [], list(TOPICS)
    for i in range(n):
        kind = kinds[i % len(kinds)]
        topics = TOPICS[kind]
        out.append((kind, topics[(i // len(kinds)) % len(topics)]))
    return out


def _raw_shards(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("raw-*.parquet"))


def generate_raw(
    target, out_dir: Path, n: int, batch_size: int = 16, max_new_tokens: int = 96, temperature: float = 1.0, seed: int = 0,
    time_limit_min: float | None = None,
) -> dict:  # fmt: skip
    """Sample user turns for jobs [done, n) of plan(n), one shard per batch; returns counts and tokens/s.
    A shard's samples depend only on (seed, its first job index): a rerun continues where it stopped."""
    from adaflash.pipelines.regenerate import answer_batch

    out_dir.mkdir(parents=True, exist_ok=True)
    done = sum(pq.read_metadata(f).num_rows for f in _raw_shards(out_dir))
    jobs = plan(n)
    dev = target.model.lm_head.weight.device
    prefixes: dict[str, list[int]] = {}
    t0, tokens, sampled = time.perf_counter(), 0, 0
    bar = tqdm(total=n, initial=min(done, n), desc="magpie", unit="turn")
    for start in range(done, n, batch_size):
        if time_limit_min is not None and time.perf_counter() - t0 > 60 * time_limit_min:
            print(f"[adaflash] magpie: time limit reached at {start}/{n} turns; rerun to continue")
            break
        batch = jobs[start : start + batch_size]
        ids = []
        for kind, topic in batch:
            system = SYSTEM.format(request=REQUEST[kind], topic=topic)
            if system not in prefixes:
                prefixes[system] = target.tokenizer.encode(user_prefix(target.tokenizer, system), add_special_tokens=False)
            ids.append(prefixes[system])
        gen = torch.Generator(dev).manual_seed(seed * 1_000_003 + start)
        answers = answer_batch(target, ids, max_new_tokens, [temperature] * len(batch), gen, features=False)
        rows = []
        for j, ((kind, topic), (resp, fin, _)) in enumerate(zip(batch, answers)):
            text = target.tokenizer.decode(resp[:-1] if fin else resp, skip_special_tokens=True)
            rows.append(dict(kind=kind, topic=topic, seed=start + j, text=text, finished=fin))
            tokens += len(resp)
        name = out_dir / f"raw-{start:07d}.parquet"
        tmp = name.with_name(f".{name.name}.tmp")
        pq.write_table(pa.Table.from_pylist(rows, schema=RAW_SCHEMA), tmp)
        tmp.replace(name)  # a shard exists once its file does
        sampled += len(batch)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    secs = time.perf_counter() - t0
    return {"turns": n, "sampled_now": sampled, "tokens": tokens, "seconds": round(secs, 1),
            "tokens_per_s": round(tokens / secs, 1) if secs > 0 else None}  # fmt: skip


def _shingles(words: list[str], n: int = 3) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def verdict(text: str, finished: bool, min_words: int = 4, max_chars: int = 1500) -> str | None:
    """Why a raw turn is not a usable prompt (None = keep, before the near-duplicate check)."""
    t = text.strip()
    if not finished:
        return "truncated"
    if len(_WORD.findall(t.lower())) < min_words:
        return "too short"
    if len(t) > max_chars:
        return "too long"
    if sum(c.isascii() for c in t) < 0.97 * len(t):
        return "not English"
    if "<|" in t or "im_start" in t:
        return "template markup"
    if _ASSISTANT_VOICE.match(t) or _REFUSAL.search(t):
        return "assistant voice or refusal"
    return None


COMMON_SHINGLE = 64
"""A word 3-gram held by more kept prompts than this ("how do i") no longer proposes near-duplicate
candidates: without the cap the check grew with the square of the prompts (20,000 took minutes). A pair
at Jaccard >= 0.6 shares most of its 3-grams, so it is still found through its rarer ones."""


def filter_raw(out_dir: Path, dup_jaccard: float = 0.6) -> dict:
    """Filter every raw shard into magpie.jsonl + report.json/report.md; returns the report."""
    raw = [r for f in _raw_shards(out_dir) for r in pq.read_table(f, schema=RAW_SCHEMA).to_pylist()]
    raw.sort(key=lambda r: r["seed"])
    kept, reasons = [], Counter()
    seen: list[set] = []
    index: dict[tuple, list[int]] = {}  # shingle -> kept prompts holding it (up to COMMON_SHINGLE + 1 of them)

    def remember(sh: set) -> None:
        for s in sh:
            post = index.setdefault(s, [])
            if len(post) <= COMMON_SHINGLE:
                post.append(len(seen))
        seen.append(sh)

    def near_duplicate(sh: set) -> bool:
        cands = {k for s in sh if len(post := index.get(s, ())) <= COMMON_SHINGLE for k in post}
        return any(len(sh & seen[k]) / len(sh | seen[k]) >= dup_jaccard for k in cands)

    for r in raw:
        why = verdict(r["text"], r["finished"])
        text = r["text"].strip()
        if why is None:
            sh = _shingles(_WORD.findall(text.lower()))
            if near_duplicate(sh):
                why = "near-duplicate"
            else:
                remember(sh)
                kept.append({**r, "text": text})
        reasons[why or "kept"] += 1
    lines = [json.dumps({"kind": r["kind"], "topic": r["topic"], "key": hashlib.sha256(r["text"].encode()).hexdigest()[:12],
                         "text": r["text"]}) for r in kept]  # fmt: skip
    (out_dir / "magpie.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))
    report = diversity_report(kept, reasons, len(raw))
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(report_markdown(report))
    return report


def diversity_report(kept: list[dict], reasons: Counter, n_raw: int) -> dict:
    """The mix per kind, drop reasons, distinct n-gram ratios (unique / total over all kept prompts) and
    topics covered per kind."""
    words = [_WORD.findall(r["text"].lower()) for r in kept]
    distinct = {}
    for n in (1, 2, 3):
        grams = [tuple(w[i : i + n]) for w in words for i in range(len(w) - n + 1)]
        distinct[f"distinct_{n}"] = round(len(set(grams)) / len(grams), 3) if grams else 0.0
    kinds = {}
    for kind in TOPICS:
        rows = [r for r in kept if r["kind"] == kind]
        kinds[kind] = {
            "kept": len(rows),
            "topics_covered": len({r["topic"] for r in rows}),
            "topics": len(TOPICS[kind]),
            "mean_words": round(sum(len(_WORD.findall(r["text"].lower())) for r in rows) / max(1, len(rows)), 1),
        }
    return {"raw_turns": n_raw, "kept": len(kept), "reasons": dict(reasons.most_common()), **distinct, "kinds": kinds,
            "examples": {k: [r["text"] for r in kept if r["kind"] == k][:2] for k in TOPICS}}  # fmt: skip


def report_markdown(rep: dict) -> str:
    lines = [
        f"# Magpie prompts: {rep['kept']} kept of {rep['raw_turns']} sampled turns",
        "",
        f"distinct 1/2/3-grams: {rep['distinct_1']} / {rep['distinct_2']} / {rep['distinct_3']}",
        "",
        "| kind | kept | topics covered | mean words |",
        "|---|---|---|---|",
        *[f"| {k} | {v['kept']} | {v['topics_covered']}/{v['topics']} | {v['mean_words']} |" for k, v in rep["kinds"].items()],
        "",
        "| verdict | turns |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rep["reasons"].items()],
        "",
    ]
    return "\n".join(lines)


@dataclass
class MagpieSection:
    """The pretraining stage `magpie` (pipelines/pretrain.py): the target writes new prompts where it
    runs (a lent GPU samples thousands a minute), continuing the sampling plan of the committed set."""

    n: int = 2400  # new user turns to sample, after the base set's (kinds round-robin)
    base: str | None = "data/magpie"  # the set continued: its raw shards are copied and its plan extended
    seed: int = 0  # the base set's (a shard's turns depend on the seed and its first job only)
    batch_size: int = 256
    max_new_tokens: int = 128  # longer turns are dropped as truncated
    temperature: float = 0.8
    time_limit_min: float | None = None  # stop sampling after this long; what was sampled is still used

    def __post_init__(self):
        if self.n < 1 or self.batch_size < 1 or self.max_new_tokens < 1 or self.temperature <= 0:
            raise ValueError("magpie.n, batch_size and max_new_tokens must be >= 1 and temperature > 0")


def run_magpie(sec: MagpieSection, target, out_dir: Path, prompts_dir: Path) -> dict:
    """Continue the base set in out_dir: its raw shards copied there, sec.n more turns sampled (jobs after
    its own), all of them filtered in one pass (so a new turn that near-duplicates a committed prompt,
    maybe one of its eval slice, is dropped), and the kept prompts added to the prompt sets in
    prompts_dir, each to its split (those already there are skipped). out_dir is then a drop-in
    successor of the base set: copied over data/magpie and committed, the next run continues after it."""
    from adaflash.pipelines.prompts import add_to_prompt_sets, magpie_records

    out_dir.mkdir(parents=True, exist_ok=True)
    base = [] if sec.base is None else _raw_shards(Path(sec.base))
    for f in base:
        if not (out_dir / f.name).exists():
            shutil.copyfile(f, out_dir / f.name)
    n_base = sum(pq.read_metadata(f).num_rows for f in base)
    stats = generate_raw(target, out_dir, n_base + sec.n, sec.batch_size, sec.max_new_tokens, sec.temperature, sec.seed, sec.time_limit_min)
    rep = filter_raw(out_dir)
    added = add_to_prompt_sets(prompts_dir, magpie_records(out_dir / "magpie.jsonl"))
    print(f"[adaflash] magpie: {rep['kept']} of {rep['raw_turns']} turns kept ({n_base} from {sec.base}), added {added}")
    return {**stats, "base_turns": n_base, "kept": rep["kept"], "added": added}


def cmd_prompts(args: argparse.Namespace) -> int:
    from adaflash.config import UsageError
    from adaflash.target import load_target, resolve_dtype

    if args.n < 1 or args.batch_size < 1:
        raise UsageError(f"-n and --batch-size must be >= 1 (got {args.n}, {args.batch_size})")
    out = Path(args.out)
    if not args.filter_only:
        from adaflash.pipelines.pretrain import stage_device

        target = load_target(args.target, resolve_dtype(args.dtype), device=stage_device(args.device))
        if target.tokenizer is None or getattr(target.tokenizer, "chat_template", None) is None:
            raise UsageError(f"target {args.target} has no chat template: Magpie needs one to write user turns")
        stats = generate_raw(target, out, args.n, args.batch_size, args.max_new_tokens, args.temperature, args.seed, args.time_limit_min)
        print(json.dumps(stats))
    if not _raw_shards(out):
        raise UsageError(f"{out} holds no raw-*.parquet shards: run without --filter-only first")
    rep = filter_raw(out)
    print(report_markdown(rep))
    print(f"wrote {out}/magpie.jsonl ({rep['kept']} prompts) and {out}/report.md")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "prompts",
        help="prompts the target writes itself (Magpie): diverse user turns across six kinds",
        description="Samples user turns from the target's own chat template, seeded by a system line naming a "
        "kind (chat, writing, reasoning, science, math, code) and a topic; filters them (truncated, length, "
        "language, assistant voice, refusals, near-duplicates) into OUT/magpie.jsonl with a report of the mix "
        "and its diversity. Resumable: a rerun continues from the shards already in OUT. Example: "
        "adaflash prompts -n 2000 --out data/magpie",
    )
    p.add_argument("-n", type=int, default=1200, help="user turns to sample in all (kinds round-robin)")
    p.add_argument("--out", default="data/magpie", help="folder for raw shards, magpie.jsonl and the report")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "auto"], help="bf16 where this CPU runs it fast")
    p.add_argument("--device", default="cpu", help="where the target samples: cpu, cuda, cuda:N, or auto (the GPU where there is one)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128, help="longer turns are dropped as truncated")
    p.add_argument(
        "--temperature", type=float, default=0.8, help="below 1: a 135M model rambles less; the report shows the diversity it keeps"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit-min", type=float, default=None, help="stop sampling after this long (rerun to continue)")
    p.add_argument("--filter-only", action="store_true", help="only re-filter the raw shards already in --out")
    p.set_defaults(func=cmd_prompts)
