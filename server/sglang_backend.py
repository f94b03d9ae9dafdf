"""The SGLang serving backend: stock SGLang (`--speculative-algorithm DFLASH`) runs the target and the
drafter, AdaFlash keeps the node (OpenAI API, /metrics, trajectory writer, registry hot-swap).

`adaflash serve --backend sglang` starts `python -m sglang.launch_server` from SGLang's own venv (a
CUDA GPU; see adaflash/dflash_sglang.py for where it is looked for) on a loopback port with the
served drafter exported in the DFlash format and a copy of the target whose embedding row
`mask_token_id` carries the drafter's learned MASK (SGLang embeds the MASK as that row).

Requests: one streamed `/generate` per request with the prompt's token ids. Trajectory rows: stock
SGLang reports per request only aggregates in `meta_info` (`spec_verify_ct`, accepted drafts, an
acceptance histogram), not per-step accept lengths. But it streams each scheduler step's tokens as
they are committed (`--stream-interval 1`), so a chunk after the first (the prefill's one token) is
one verify step committing accepted + 1 tokens, and the row's rounds are exact (anchor, accepted,
verify length) whenever the request's chunks number `spec_verify_ct` + 1 and agree with the
histogram. When the HTTP layer merged steps into one chunk, the step boundaries inside it are
unknown: the row then carries no rounds (the trainer skips it; `stats["rows_inexact"]` counts them)
rather than invented anchors. The last round of a request that stopped inside a step counts the
tokens kept, a lower bound. Drafted tokens are not reported and are recorded empty (the trainer reads
anchors only: trainer/data.py). Sampled requests are not seeded (SGLang builds differ on the field).

Hot-swap (`sglang.swap`): `restart` exports the version, writes its target copy and restarts SGLang
with drain: new requests wait, those in flight finish, nothing is dropped (the stall is the drain
plus SGLang's start-up). `auto` first tries SGLang's in-place `/update_weights_from_disk` on the
draft model (stock builds route it to the target, or fail for DFlash: upstream PR #35403; builds
with a draft selector take `sglang.swap_request` fields), then checks it with greedy probes: the
probe outputs must be unchanged (the target did not change) and their acceptance must differ (the
draft did); otherwise, or when the version's MASK differs (it lives in the target), it restarts.
`inplace` refuses the version instead of restarting (restoring the old one if the target changed).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import torch
from adaflash.server.stock_backend import ChildServer, StockEngine, free_port

from adaflash.buffer import Round
from adaflash.dflash_format import export_dflash
from adaflash.dflash_sglang import sglang_python, write_sglang_target
from adaflash.request import DrafterSlot

log = logging.getLogger("adaflash.server")


class SGLangServer(ChildServer):
    """SGLang's server (`sglang.launch_server`) as a child process, DFLASH on when a drafter is given."""

    name = "SGLang"

    def __init__(
        self,
        python: Path,
        target_dir: Path,
        drafter_dir: Path | None,
        num_draft_tokens: int,
        port: int,
        context_length: int,
        max_running: int,
        dtype: str,
        mem_fraction: float,
        log_path: Path,
        extra_args: list[str] | None = None,
    ):
        self.args = dict(locals())
        del self.args["self"], self.args["__class__"]
        self.target_dir, self.drafter_dir = Path(target_dir), drafter_dir and Path(drafter_dir)
        self.incremental = "--incremental-streaming-output" in (extra_args or [])  # chunks carry new ids only
        cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(target_dir), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--dtype", dtype, "--context-length", str(context_length)]
        cmd += ["--max-running-requests", str(max_running), "--mem-fraction-static", str(mem_fraction)]
        cmd += ["--served-model-name", "target", "--random-seed", "0", "--stream-interval", "1"]  # a chunk per step
        if drafter_dir is not None:
            cmd += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter_dir)]
            cmd += ["--speculative-num-draft-tokens", str(num_draft_tokens)]  # tokens verified per step (block)
        super().__init__(cmd + list(extra_args or []), dict(os.environ), port, log_path)

    def with_dirs(self, target_dir: Path, drafter_dir: Path | None) -> "SGLangServer":
        """The same server over other model directories (a restart)."""
        return SGLangServer(**{**self.args, "target_dir": target_dir, "drafter_dir": drafter_dir})

    def update_draft(self, draft_dir: Path, version: str, fields: dict, timeout: float = 600.0) -> tuple[bool, str]:
        """SGLang's in-place weight update aimed at the draft; -> (SGLang's success, its message). SGLang
        waits for running requests to finish and holds new ones meanwhile (abort_all_requests false)."""
        body = {"model_path": str(draft_dir), "abort_all_requests": False, "weight_version": str(version), **fields}
        try:
            r = httpx.post(self.url + "/update_weights_from_disk", json=body, timeout=timeout)
        except httpx.HTTPError as e:
            return False, f"{type(e).__name__}: {e}"
        try:
            out = r.json()
        except ValueError:
            out = {"message": r.text[:300]}
        return r.status_code == 200 and bool(out.get("success", False)), str(out.get("message", ""))[:500]

    def probe(self, prompts: list[list[int]], max_new_tokens: int) -> list[tuple]:
        """Greedy probes: per prompt (output ids, verify steps, accepted drafts) from meta_info."""
        out = []
        for ids in prompts:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
            r = httpx.post(self.url + "/generate", json=body, timeout=600)
            r.raise_for_status()
            res = r.json()
            res = res[0] if isinstance(res, list) else res
            out.append((tuple(res.get("output_ids") or []), *_spec_counts(res.get("meta_info") or {})))
        return out


def _spec_counts(meta: dict) -> tuple[int | None, int | None]:
    """(verify steps, accepted drafts) of one response's meta_info; newer and older SGLang field names."""
    accepted = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts", meta.get("spec_accept_token_num")))
    return meta.get("spec_verify_ct"), accepted


def judge_probes(before: list[tuple], after: list[tuple]) -> tuple[bool, str]:
    """Did an in-place update change the draft and not the target? Greedy output is the target's
    alone, so the probes' output ids must stay; their acceptance must move (the draft is new)."""
    if [b[0] for b in before] != [a[0] for a in after]:
        return False, "the target changed: greedy probe outputs differ after the update"
    if [b[1:] for b in before] == [a[1:] for a in after]:
        return False, "the draft did not change: probe acceptance is identical after the update"
    return True, "draft changed, target unchanged"


def swap_plan(mode: str, mask_changed: bool) -> str:
    """'inplace' or 'restart' for swap mode `mode`; raises where `inplace` cannot work."""
    if mode == "restart":
        return "restart"
    if mask_changed:  # the MASK is a row of SGLang's target: only a restart loads a new one
        if mode == "inplace":
            raise ValueError("the version's MASK differs and lives in SGLang's target; sglang.swap inplace cannot change it")
        return "restart"
    return "inplace"


def rounds_from_chunks(prompt_len: int, chunks: list[int], meta: dict, k_blk: int) -> list[Round] | None:
    """Streamed chunk sizes (new tokens per chunk) + the final meta_info -> exact rounds, [] without
    speculation, or None when the chunks cannot be one verify step each (the module docstring)."""
    verify_ct, _ = _spec_counts(meta)
    if verify_ct is None:
        return []
    if not chunks or chunks[0] != 1 or len(chunks) - 1 != verify_ct or any(n > k_blk for n in chunks[1:]):
        return None
    rounds, committed, t_ns = [], 1, time.time_ns()
    for n in chunks[1:]:
        rounds.append(Round(anchor=prompt_len + committed - 1, draft=[], target=[], accepted=n - 1, verify_len=k_blk, t_ns=t_ns))
        committed += n
    hist = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram")
    if hist:  # the steps' accepted counts (the last one may be cut by the stop) must fit SGLang's histogram
        seen = Counter(r.accepted for r in rounds[:-1])
        if any(c > (hist[k] if k < len(hist) else 0) for k, c in seen.items()) or sum(hist) != verify_ct:
            return None
    return rounds


class SGLangEngine(StockEngine):
    """The EngineRunner's engine surface over an SGLang server (one streamed /generate per request)."""

    def __init__(
        self, server: SGLangServer, drafter, version: str, k_blk: int, limits: tuple, cfg, base_target: Path, mask_token, probe_ids
    ):
        """limits: (max_batch, token_budget, max_model_len); cfg: the SGLangSection; base_target: the plain
        target directory (target copies carry a version's MASK); probe_ids: greedy swap-probe prompts."""
        policy = f"sglang-dflash{k_blk}" if drafter is not None else "sglang-ar"
        super().__init__(server, drafter, version, policy, k_blk if drafter is not None else 1, *limits)
        self.cfg, self.work_dir, self.base_target = cfg, Path(cfg.work_dir), base_target
        self.mask_token, self.probe_ids = mask_token, probe_ids
        self.stats.update(swap_mode=None)

    def _export(self, drafter, version: str) -> Path:
        out = self.work_dir / f"dflash-v{version}"
        shutil.rmtree(out, ignore_errors=True)
        return export_dflash(drafter, out, self.cfg.mask_token_id, None, self.mask_token)

    def submit(self, req) -> None:
        if self.slot.drafter is not None and self.cfg.mask_token_id in req.prompt_ids:
            raise ValueError(f"prompt contains token {self.cfg.mask_token_id}, the MASK row of SGLang's target")
        super().submit(req)

    # ----------------------------------------------------------------- hot-swap

    def swap(self, drafter, head=None, version: str = "0") -> None:
        """Serve a checked drafter: in place (checked by probes) or by a drop-free restart (module docstring)."""
        old = self.slot.drafter
        if old is None:
            raise ValueError("this SGLang server runs without a drafter: nothing to swap")
        if drafter.block_size != old.block_size:
            raise ValueError(f"drafter block size {drafter.block_size} != served block size {old.block_size}")
        mask_changed = not torch.equal(drafter.mask_embedding.detach().float().cpu(), old.mask_embedding.detach().float().cpu())
        plan = swap_plan(self.cfg.swap, mask_changed)
        draft_dir = self._export(drafter, version)
        t0 = time.perf_counter()
        if plan == "inplace":
            before = self.server.probe(self.probe_ids, self.cfg.probe_tokens)
            ok, why = self.server.update_draft(draft_dir, version, self.cfg.swap_request)
            if ok:
                ok, why = judge_probes(before, self.server.probe(self.probe_ids, self.cfg.probe_tokens))
            if not ok:
                log.warning("SGLang in-place draft update to version %s not usable: %s", version, why)
                if self.cfg.swap == "inplace":
                    if why.startswith("the target changed"):
                        self._restart(self.server.target_dir, self.server.drafter_dir)  # back to the old weights
                    raise RuntimeError(f"SGLang in-place draft update refused: {why}")
                plan = "restart"
            else:  # SGLang now serves this export: a later restart must load it too
                self.server.drafter_dir = self.server.args["drafter_dir"] = draft_dir
        if plan == "restart":
            target_dir = self.server.target_dir
            if mask_changed:
                mask = drafter.mask_embedding.detach().float().cpu()
                target_dir = write_sglang_target(self.base_target, self.work_dir / f"target-v{version}", self.cfg.mask_token_id, mask)
            self._restart(target_dir, draft_dir)
        took = time.perf_counter() - t0
        log.info("SGLang drafter swap to version %s (%s) in %.2f s", version, plan, took)
        self.slot = DrafterSlot(drafter, head, version)
        self.stats.update(swaps=self.stats["swaps"] + 1, last_swap_s=round(took, 3), swap_mode=plan)

    def _restart(self, target_dir: Path, draft_dir: Path | None) -> None:
        """Restart SGLang over these directories without dropping a request; on failure the old child
        comes back and the error is raised."""
        old = self.server
        self.hold()
        try:
            old.stop()
            new = old.with_dirs(target_dir, draft_dir)
            try:
                new.start(self.cfg.startup_timeout_s)
            except Exception:
                log.error("SGLang did not start over %s / %s; restarting the previous one", target_dir, draft_dir)
                old = old.with_dirs(old.target_dir, old.drafter_dir)
                old.start(self.cfg.startup_timeout_s)
                self.server = old
                raise
            self.server = new
        finally:
            self.release()

    # ----------------------------------------------------------------- one request

    def _request(self, st) -> tuple[str | None, list[Round] | None]:
        req = st.req
        params = {"max_new_tokens": req.max_new_tokens, "temperature": req.temperature, "skip_special_tokens": False}
        params["ignore_eos"] = req.ignore_eos
        params["no_stop_trim"] = True  # keep the stop token: it was committed by a verify step
        body = {"input_ids": list(req.prompt_ids), "sampling_params": params, "stream": True}
        finish, meta, chunks = None, {}, []
        for chunk in self._events(st, "/generate", body):
            ids = chunk.get("output_ids") or []
            new = ids if self.server.incremental else ids[len(st.out) :]
            if new:
                chunks.append(len(new))
                self._progress(st, new)
            meta = chunk.get("meta_info") or meta
            reason = (meta.get("finish_reason") or {}).get("type") if isinstance(meta.get("finish_reason"), dict) else None
            if reason:
                finish = {"abort": "cancelled"}.get(reason, reason)
            if req.stop is not None and finish != "cancelled" and (keep := req.stop(st.out)) is not None:
                del st.out[keep:]
                finish = "stop"  # a custom stop rule: leave the stream, SGLang aborts the request
                break
        return finish, rounds_from_chunks(len(req.prompt_ids), chunks, meta, self.k_blk) if finish != "cancelled" else []


PROBE_TEXTS = ("Explain in two sentences why the sky is blue.", "Write a Python function that returns the n-th Fibonacci number.")


def build_sglang_engine(cfg, target) -> SGLangEngine:
    """The ServeConfig's model served by an SGLang child process (started here; ready when this returns)."""
    from adaflash.drafter import load_drafter
    from adaflash.target import stock_hf_dir

    m, e, s = cfg.model, cfg.engine, cfg.sglang
    python = sglang_python(s.python)  # fails first, saying what to install
    drafter = None if m.policy == "ar" else load_drafter(m.drafter, target.model, target.identity, torch.float32)
    k_blk = m.fixed_len or (drafter.block_size if drafter is not None else 1)
    if drafter is not None and not 2 <= k_blk <= drafter.block_size:
        raise ValueError(f"model.policy {m.policy}: the SGLang backend verifies 2..{drafter.block_size} tokens per step")
    if drafter is not None and drafter.vocab is not None:
        log.warning("SGLang drafts over the target's full LM head: the drafter's reduced draft vocabulary is not used there")
    tok = target.tokenizer
    mask_token = tok.convert_ids_to_tokens(s.mask_token_id) if tok is not None else None
    work, base = Path(s.work_dir), stock_hf_dir(m.target)
    target_dir, draft_dir = base, None
    if drafter is not None:
        draft_dir = work / f"dflash-v{m.drafter_version}"
        shutil.rmtree(draft_dir, ignore_errors=True)
        export_dflash(drafter, draft_dir, s.mask_token_id, None, mask_token)
        mask = drafter.mask_embedding.detach().float().cpu()
        target_dir = write_sglang_target(base, work / f"target-v{m.drafter_version}", s.mask_token_id, mask)
    ctx = target.model.config.max_position_embeddings
    max_len = min(e.max_model_len or ctx, ctx)
    args = (python, target_dir, draft_dir, k_blk, s.port or free_port(), max_len, e.max_batch, m.dtype, s.mem_fraction_static)
    server = SGLangServer(*args, work / "sglang.log", s.extra_args)
    server.start(s.startup_timeout_s)
    probes = [target.encode_chat(t) for t in PROBE_TEXTS]
    limits = (e.max_batch, e.token_budget, max_len)
    return SGLangEngine(server, drafter, m.drafter_version, k_blk, limits, s, base, mask_token, probes)
