"""Stage (a) of pretraining: the target answers the training prompts itself ("regenerated" data).

On a CPU the answers come from the serving engine's plain decoding (adaflash.engine: continuous
batching, prompts packed without padding, the C++ decoder stack where the CPU has it), a finished
request's slot refilled at once; on a GPU from padded batched decoding (`answer_batch`: left-padded,
finished rows dropped), where one padded call per step is what a GPU runs best and the engine's
per-request prefill calls would not be. Either way one shard per `batch_size` answers:
`answers-NNNNN.parquet` (prompt id, domain, prompt and response token ids, sampling temperature) and,
beside it, `answers-NNNNN.features.safetensors` holding the target-layer hidden states of every token
that was fed to the target (all but the last one). Those are exactly the drafter's context features,
recorded for free while generating, so CPU training never runs the target again. On a GPU, where a
target forward is cheap and 16 KB of features per token are not, `store_features=False` keeps token
ids only and training recomputes the features (pretrain `train.features: target`).

Each prompt gets its greedy answer (id = the prompt's id) and optionally `samples` extra answers
sampled at `temperature` (ids `<prompt id>#s1`, `#s2`, ...): more of the target's own text per prompt
when prompts are few. The Parquet file is written last and atomically: a shard exists once its
Parquet file does. A rerun skips answers already written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from adaflash.engine import Engine
from adaflash.policies import ARPolicy
from adaflash.request import Request
from adaflash.spec import sample
from adaflash.target import Target

SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("domain", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("finished", pa.bool_()),  # ended with EOS (else hit max_new_tokens)
        ("feat_offset", pa.int64()),  # first row of this sequence in the shard's feature tensor (-1: none stored)
        ("temperature", pa.float32()),  # 0 = greedy
    ]
)


def done_prompt_ids(out_dir: Path) -> set[str]:
    done: set[str] = set()
    for f in sorted(out_dir.glob("answers-*.parquet")):
        done.update(pq.read_table(f, columns=["prompt_id"]).column("prompt_id").to_pylist())
    return done


def _next_shard(out_dir: Path) -> int:
    nums = [int(f.name.split("-")[1].split(".")[0]) for f in out_dir.glob("answers-*.parquet")]
    return max(nums, default=-1) + 1


def next_tokens(logits: torch.Tensor, temps: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, V], temps [B] (0 = greedy) -> next ids [B]: argmax, or a sample at the row's temperature."""
    greedy = logits.argmax(-1)
    if not bool((temps > 0).any()):
        return greedy
    probs = torch.softmax(logits / temps.clamp(min=1e-6)[:, None], dim=-1)
    sampled = sample(probs, gen)  # [B]
    return torch.where(temps > 0, sampled, greedy)


@torch.no_grad()
def answer_batch(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    temps: list[float] | None = None,
    gen: torch.Generator | None = None,
    features: bool = True,
) -> list[tuple[list[int], bool, torch.Tensor | None]]:
    """Answers for a batch -> per prompt (response ids, ended with EOS, features [P+R-1, n*H] or None).
    `temps`: per prompt sampling temperature (None or 0 = greedy)."""
    model, eos = target.model, set(target.eos_ids)
    dev = model.lm_head.weight.device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        valid[i, width - len(p) :] = True
    t_rows = torch.tensor(temps or [0.0] * b, dtype=torch.float32, device=dev)  # [B]
    cache = model.new_cache(b, width + max_new_tokens)
    logits, feats = model(ids.to(dev), cache, valid=valid.to(dev), logits_last_only=True)
    feat_rows = [[feats[i, width - len(p) :].cpu()] if features else [] for i, p in enumerate(prompts)]
    responses: list[list[int]] = [[] for _ in prompts]
    finished = [False] * b
    live = list(range(b))  # batch row -> prompt index
    nxt = next_tokens(logits[:, -1], t_rows, gen)  # [B]
    for step in range(max_new_tokens):
        keep = []
        for row, (i, tok) in enumerate(zip(live, nxt.tolist())):
            responses[i].append(tok)
            if tok in eos:
                finished[i] = True
            elif step + 1 < max_new_tokens:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(live):
            rows = torch.tensor(keep, device=dev)
            cache.select_rows(rows)
            nxt, t_rows = nxt[rows], t_rows[rows]
            live = [live[r] for r in keep]
        logits, feats = model(nxt[:, None], cache, logits_last_only=True)
        if features:
            feats = feats.cpu()
            for row, i in enumerate(live):
                feat_rows[i].append(feats[row])
        nxt = next_tokens(logits[:, -1], t_rows, gen)
    return [(responses[i], finished[i], torch.cat(feat_rows[i]) if features else None) for i in range(b)]


def batches(lengths: list[int], batch_size: int, max_batch_tokens: int | None) -> list[tuple[int, int]]:
    """Split items (in `answer_order`: lengths mostly rising) into [start, end) runs of at most `batch_size`
    items whose padded prompt size (count x longest) stays within `max_batch_tokens`: long prefills fit."""
    out, start = [], 0
    while start < len(lengths):
        end, longest = start + 1, lengths[start]
        while (
            end < len(lengths)
            and end - start < batch_size
            and (max_batch_tokens is None or (end + 1 - start) * max(longest, lengths[end]) <= max_batch_tokens)
        ):
            longest = max(longest, lengths[end])
            end += 1
        out.append((start, end))
        start = end
    return out


ORDER_BANDS = 8  # `answer_order`: a round advances every domain by an eighth of its prompts at a time


def answer_order(jobs: list[tuple], prompt_len: dict[str, int]) -> list[tuple]:
    """Jobs (record, answer id, temperature) in the order they are answered: every prompt's greedy answer
    first, then each round of sampled answers (`#s1`, `#s2`, ...); within a round every domain advances
    at the same pace, each shortest prompts first: a job's band is its length rank within its domain's
    jobs of the round, in eighths, and each band goes shortest first (similar lengths still batch together:
    one long prompt pads only its own batch). A time limit then cuts about the same share of every
    domain, not a whole domain of long prompts: by length alone, the first GPU continuation's limit left
    68 of HumanEval's 76 prompts without a single answer, and a greedy round that does not finish (10,000
    prompts) would have cut HumanEval and the code prompts, the longest."""

    def sample(job):
        rec, answer_id, _ = job
        return int(answer_id.rsplit("#s", 1)[1]) if answer_id != rec.prompt_id else 0

    groups: dict[tuple, list] = {}  # (sample round, domain) -> its jobs
    for job in jobs:
        groups.setdefault((sample(job), job[0].domain), []).append(job)
    key = {}  # answer id -> (round, band, prompt length)
    for (rnd, _), group in groups.items():
        group.sort(key=lambda j: prompt_len[j[0].prompt_id])
        for rank, (rec, answer_id, _) in enumerate(group):
            key[answer_id] = (rnd, int(ORDER_BANDS * (rank + 0.5) / len(group)), prompt_len[rec.prompt_id])
    return sorted(jobs, key=lambda j: key[j[1]])


def regen_engine(target: Target, batch_size: int, longest: int, max_batch_tokens: int | None = None, keep_features: bool = True) -> Engine:
    """The engine regeneration answers with on a CPU: plain decoding of `batch_size` requests at a time,
    keeping every fed token's features, its token budget room for the `longest` prompt beside a full batch."""
    budget = max(max_batch_tokens or 0, 2048, longest + batch_size)
    return Engine(target.model, None, ARPolicy(), target.eos_ids, max_batch=batch_size, token_budget=budget, keep_features=keep_features)


def _seed(seed: int, answer_id: str) -> int:
    """A sampled answer's generator seed: from the run's seed and the answer's id."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{answer_id}".encode()).digest()[:8], "little") >> 1


def regenerate(
    target: Target,
    records: list,
    out_dir: Path,
    batch_size: int,
    max_new_tokens: int,
    samples: int = 0,
    temperature: float = 0.8,
    store_features: bool = True,
    seed: int = 0,
    time_limit_min: float | None = None,
    max_batch_tokens: int | None = None,
) -> dict:
    """Answer every (record, sample) not answered yet; returns counts and throughput.
    Stops after the batch that crosses `time_limit_min` (a rerun continues)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    done = done_prompt_ids(out_dir)
    jobs = [(r, f"{r.prompt_id}#s{j}" if j else r.prompt_id, temperature if j else 0.0) for r in records for j in range(samples + 1)]
    todo = [j for j in jobs if j[1] not in done]
    chats = {r.prompt_id: target.encode_chat(r.messages) for r in {r.prompt_id: r for r, _, _ in todo}.values()}
    encoded = answer_order(todo, {pid: len(c) for pid, c in chats.items()})
    shard = _next_shard(out_dir)
    dev = target.model.lm_head.weight.device
    t0, new_tokens, answered = time.perf_counter(), 0, 0
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="regenerate", unit="answer")

    def write(answers: list[tuple]) -> None:  # [(job, response ids, ended with EOS, features [P+R-1, n*H] or None)]
        nonlocal shard, new_tokens, answered
        rows, feats, offset = [], [], 0
        for (rec, answer_id, temp), resp, fin, f in answers:
            rows.append(
                dict(
                    prompt_id=answer_id,
                    domain=rec.domain,
                    prompt_ids=chats[rec.prompt_id],
                    response_ids=resp,
                    finished=fin,
                    feat_offset=offset if store_features else -1,
                    temperature=temp,
                )
            )
            if store_features:
                feats.append(f.cpu())
                offset += f.shape[0]
            new_tokens += len(resp)
        name = f"answers-{shard:05d}"
        if store_features:
            save_file({"features": torch.cat(feats).to(torch.bfloat16).contiguous()}, str(out_dir / f"{name}.features.safetensors"))
        tmp = out_dir / f".{name}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
        os.replace(tmp, out_dir / f"{name}.parquet")
        shard += 1
        answered += len(answers)
        bar.update(len(answers))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")

    def over_time(left: int) -> bool:
        if time_limit_min is None or time.perf_counter() - t0 <= 60 * time_limit_min:
            return False
        print(f"[adaflash] regenerate: time limit reached with {left} answers to go; rerun to continue")
        return True

    if dev.type == "cpu":  # the engine: continuous batching, no padding
        longest = max((len(c) for c in chats.values()), default=0)
        engine = regen_engine(target, batch_size, longest, max_batch_tokens, keep_features=store_features)
        jobs_by_id = {answer_id: (rec, answer_id, temp) for rec, answer_id, temp in encoded}
        for rec, answer_id, temp in encoded:  # an answer's sample depends on its id and the seed alone, not on its batch
            engine.submit(Request(answer_id, chats[rec.prompt_id], max_new_tokens, temp, _seed(seed, answer_id)))
        answers = []  # finished, not yet in a shard: (job, response ids, ended with EOS, features)
        while not engine.idle and not over_time(len(encoded) - answered - len(answers)):
            answers += [(jobs_by_id[st.req.request_id], st.out, st.finish_reason == "stop", st.features) for st in engine.step()]
            while len(answers) >= batch_size:
                write(answers[:batch_size])
                answers = answers[batch_size:]
        if answers:  # the last, shorter shard (or what finished before the time limit)
            write(answers)
    else:
        for start, end in batches([len(chats[r.prompt_id]) for r, _, _ in encoded], batch_size, max_batch_tokens):
            if over_time(len(encoded) - start):
                break
            batch = encoded[start:end]
            gen = torch.Generator(dev).manual_seed(seed * 1_000_003 + shard)  # a shard's samples are reproducible
            prompts, temps = [chats[r.prompt_id] for r, _, _ in batch], [t for _, _, t in batch]
            answers = answer_batch(target, prompts, max_new_tokens, temps, gen, features=store_features)
            write([(job, *answer) for job, answer in zip(batch, answers)])
    bar.close()
    stats = {
        "prompts": len(records),
        "answers": len(jobs),
        "answered_now": answered,
        "new_tokens": new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "done": answered == len(todo),
    }
    (out_dir / "last_run.json").write_text(json.dumps(stats, indent=2))
    return stats
