"""Stage (a) of pretraining: the target answers the training prompts itself ("regenerated" data).

Greedy batched decoding (left-padded, finished rows dropped from the batch) writes one shard per
batch: `answers-NNNNN.parquet` (prompt id, domain, prompt and response token ids) and, beside it,
`answers-NNNNN.features.safetensors` holding the target-layer hidden states of every token that was
fed to the target (all but the last one). Those are exactly the drafter's context features, recorded
for free while generating, so training never runs the target again. The Parquet file is written last
and atomically: a shard exists once its Parquet file does. A rerun skips prompts already answered.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from adaflash.target import Target

SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("domain", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("finished", pa.bool_()),  # ended with EOS (else hit max_new_tokens)
        ("feat_offset", pa.int64()),  # first row of this sequence in the shard's feature tensor
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


@torch.no_grad()
def answer_batch(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], bool, torch.Tensor]]:
    """Greedy answers for a batch -> per prompt (response ids, ended with EOS, features [P+R-1, n*H])."""
    model, eos = target.model, set(target.eos_ids)
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        valid[i, width - len(p) :] = True
    cache = model.new_cache(b, width + max_new_tokens)
    logits, feats = model(ids, cache, valid=valid, logits_last_only=True)
    feat_rows = [[feats[i, width - len(p) :]] for i, p in enumerate(prompts)]  # per prompt: list of [t, n*H]
    responses: list[list[int]] = [[] for _ in prompts]
    finished = [False] * b
    live = list(range(b))  # batch row -> prompt index
    nxt = logits[:, -1].argmax(-1)  # [B]
    for step in range(max_new_tokens):
        keep = []
        for row, i in enumerate(live):
            tok = int(nxt[row])
            responses[i].append(tok)
            if tok in eos:
                finished[i] = True
            elif step + 1 < max_new_tokens:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(live):
            cache.select_rows(torch.tensor(keep))
            nxt = nxt[keep]
            live = [live[r] for r in keep]
        logits, feats = model(nxt[:, None], cache, logits_last_only=True)
        for row, i in enumerate(live):
            feat_rows[i].append(feats[row])
        nxt = logits[:, -1].argmax(-1)
    return [(responses[i], finished[i], torch.cat(feat_rows[i])) for i in range(b)]


def regenerate(target: Target, records: list, out_dir: Path, batch_size: int, max_new_tokens: int) -> dict:
    """Answer every record not answered yet; returns counts and throughput."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    done = done_prompt_ids(out_dir)
    todo = [r for r in records if r.prompt_id not in done]
    encoded = [(r, target.encode_chat(r.messages)) for r in todo]
    encoded.sort(key=lambda e: len(e[1]))  # similar lengths batch together: less padding
    shard = _next_shard(out_dir)
    t0, new_tokens = time.perf_counter(), 0
    bar = tqdm(total=len(records), initial=len(records) - len(todo), desc="regenerate", unit="prompt")
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start : start + batch_size]
        answers = answer_batch(target, [e[1] for e in batch], max_new_tokens)
        rows, feats, offset = [], [], 0
        for (rec, prompt_ids), (resp, fin, f) in zip(batch, answers):
            rows.append(dict(prompt_id=rec.prompt_id, domain=rec.domain, prompt_ids=prompt_ids, response_ids=resp,
                             finished=fin, feat_offset=offset))
            feats.append(f)
            offset += f.shape[0]
            new_tokens += len(resp)
        name = f"answers-{shard:05d}"
        save_file({"features": torch.cat(feats).to(torch.bfloat16).contiguous()}, str(out_dir / f"{name}.features.safetensors"))
        tmp = out_dir / f".{name}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
        os.replace(tmp, out_dir / f"{name}.parquet")
        shard += 1
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    stats = {"prompts": len(records), "answered_now": len(todo), "new_tokens": new_tokens,
             "seconds": round(time.perf_counter() - t0, 1)}
    (out_dir / "last_run.json").write_text(json.dumps(stats, indent=2))
    return stats
