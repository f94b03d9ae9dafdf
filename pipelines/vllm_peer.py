"""Stock vLLM as a peer in `adaflash bench`: run by vLLM's own Python (its venv, `make vllm`), not ours,
so it imports nothing of AdaFlash.

usage: python vllm_peer.py JOB_JSON OUT_JSON

JOB_JSON: {"target": dir, "dtype": "float32", "threads": int, "max_new": int, "max_batched_tokens": int,
           "speculative": null | {"method": "ngram" | "dflash", ...vLLM speculative_config...},
           "cells": [{"key": str, "concurrency": int, "prompts": [[token ids], ...]}, ...]}
OUT_JSON: {"startup_s": float, "cells": {key: {"tokens": int, "wall_s": float, "acceptance": float | null,
           "outputs": [[token ids], ...]}}}

One engine per job (start-up is paid once, outside the timed cells); a cell runs with at most
`concurrency` requests in flight, a new one admitted as one finishes (a closed loop, as our bench),
greedy, and its wall time covers only its own requests. A warm-up request runs first.
"""

import json
import sys
import time


def run_cell(llm, params, prompts: list[list[int]], concurrency: int) -> tuple[list[list[int]], float, float | None]:
    """Closed loop at `concurrency` through the engine's own request queue -> (outputs, wall s, mean acceptance)."""
    engine = llm.llm_engine
    pending = list(enumerate(prompts))
    outputs: dict[int, list[int]] = {}
    accept: list[float] = []
    in_flight = 0
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, ids = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
                m = getattr(out.outputs[0], "spec_decode_metrics", None)
                if m is not None:
                    accept.append(m.to_dict()["mean_acceptance_length"])
                in_flight -= 1
    wall = time.perf_counter() - t0
    return [outputs[i] for i in range(len(prompts))], wall, (sum(accept) / len(accept) if accept else None)


def main() -> None:
    job = json.load(open(sys.argv[1]))
    import torch
    from vllm import LLM, SamplingParams

    torch.set_num_threads(int(job["threads"]))
    spec = job.get("speculative")
    t0 = time.perf_counter()
    llm = LLM(
        model=job["target"],
        dtype=job.get("dtype", "float32"),
        speculative_config=spec,
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=max(c["concurrency"] for c in job["cells"]),
        # the tokens one step may carry, as the bench's token budget bounds our engine's (vllm_batched_tokens)
        max_num_batched_tokens=int(job.get("max_batched_tokens", 512)),
        seed=0,
        # every request prefills its prompt, as in our engine (no prefix cache): the cells of a run reuse the same
        # prompts, and with vLLM's default prefix caching its plain decoding skipped their prefill from the second
        # cell on (humaneval c=32: 343 tok/s with the hits, 219 without) while its DFlash path did not
        enable_prefix_caching=False,
        per_request_spec_decode_metrics="detailed" if spec else "none",
    )
    params = SamplingParams(temperature=0, max_tokens=int(job["max_new"]))
    llm.generate([{"prompt_token_ids": job["cells"][0]["prompts"][0]}], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    startup = time.perf_counter() - t0
    cells = {}
    for c in job["cells"]:
        outs, wall, acc = run_cell(llm, params, c["prompts"], int(c["concurrency"]))
        cells[c["key"]] = {"tokens": sum(len(o) for o in outs), "wall_s": wall, "acceptance": acc, "outputs": outs}
        print(f"vllm peer: {c['key']}: {cells[c['key']]['tokens'] / wall:.1f} tok/s", file=sys.stderr, flush=True)
    json.dump({"startup_s": startup, "cells": cells}, open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this file
    main()
