"""llama.cpp as a peer in `adaflash bench`: run by the Python of its own venv (`make llamacpp`), not ours,
so it imports nothing of AdaFlash.

usage: python llamacpp_peer.py JOB_JSON OUT_JSON

JOB_JSON: {"gguf": path, "threads": int, "max_new": int, "eos": [token ids],
           "cells": [{"key": str, "concurrency": 1, "prompts": [[token ids], ...]}, ...]}
OUT_JSON: {"startup_s": float, "version": str, "cells": {key: {"tokens": int, "wall_s": float, "acceptance": null,
           "outputs": [[token ids], ...]}}}

The GGUF is the file the target comes from (the same vocabulary: the bench's token ids are llama.cpp's).
Plain greedy decoding, one request at a time (llama-cpp-python runs one sequence; concurrency 1 only),
each request from an empty cache: its prompt's prefill is in its time, as in the engines it is compared
with. An output ends at an EOS token (kept, as the engines keep it) or at max_new tokens. A warm-up
request runs first.
"""

import json
import sys
import time


def run_cell(llm, prompts: list[list[int]], max_new: int, eos: set[int]) -> tuple[list[list[int]], float]:
    """Each prompt greedily to EOS or max_new tokens, one after another -> (outputs, wall s)."""
    outputs = []
    t0 = time.perf_counter()
    for ids in prompts:
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(ids, temp=0.0, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= max_new:
                break
        outputs.append(out)
    return outputs, time.perf_counter() - t0


def main() -> None:
    job = json.load(open(sys.argv[1]))
    import llama_cpp

    if any(c["concurrency"] != 1 for c in job["cells"]):
        raise SystemExit("llama-cpp-python decodes one sequence at a time: concurrency 1 cells only")
    threads = int(job["threads"])
    longest = max(len(p) for c in job["cells"] for p in c["prompts"]) + job["max_new"] + 8
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=job["gguf"], n_ctx=max(512, longest), n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    eos = set(job["eos"]) | {llm.token_eos()}
    run_cell(llm, [job["cells"][0]["prompts"][0]], 8, eos)  # warm-up
    startup = time.perf_counter() - t0
    cells = {}
    for c in job["cells"]:
        outputs, wall = run_cell(llm, c["prompts"], job["max_new"], eos)
        cells[c["key"]] = {"tokens": sum(map(len, outputs)), "wall_s": wall, "acceptance": None, "outputs": outputs}
        print(f"{c['key']}: {cells[c['key']]['tokens'] / wall:.1f} tok/s", flush=True)
    json.dump({"startup_s": startup, "version": llama_cpp.__version__, "cells": cells}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
