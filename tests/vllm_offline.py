"""Run by vLLM's own Python (tests/test_vllm.py): stock vLLM's offline engine on token-id prompts,
plain decoding and then DFlash speculative decoding with a drafter directory, greedy.

usage: vllm_offline.py TARGET_DIR DRAFTER_DIR NUM_SPEC MAX_TOKENS PROMPTS_JSON OUT_JSON
PROMPTS_JSON holds a list of token-id lists; OUT_JSON gets {"plain": [ids...], "dflash": [ids...],
"mean_acceptance_length": [...], "wall_s": {...}}.
"""

import gc
import json
import sys
import time


def run(target: str, spec: dict | None, prompts: list[list[int]], max_tokens: int):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target,
        dtype="float32",
        speculative_config=spec,
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
        per_request_spec_decode_metrics="detailed" if spec else "none",
    )
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    wall = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    acc = []
    for o in outs:
        m = o.outputs[0].spec_decode_metrics
        acc.append(m.to_dict()["mean_acceptance_length"] if m is not None else None)
    del llm
    gc.collect()
    return ids, acc, wall


def main() -> None:
    target, drafter, num_spec, max_tokens, prompts_path, out_path = sys.argv[1:7]
    prompts = json.load(open(prompts_path))
    plain, _, t_plain = run(target, None, prompts, int(max_tokens))
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": int(num_spec)}
    dflash, acc, t_dflash = run(target, spec, prompts, int(max_tokens))
    json.dump(
        {"plain": plain, "dflash": dflash, "mean_acceptance_length": acc, "wall_s": {"plain": t_plain, "dflash": t_dflash}},
        open(out_path, "w"),
    )


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this file
    main()
