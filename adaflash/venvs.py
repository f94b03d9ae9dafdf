"""The Pythons of the peer engines' own venvs (vLLM, SGLang, llama.cpp): each runs in a venv of its own, so
its pinned torch and build never meet the project's. One rule for all three: the configured path or the
environment variable where given, else the default locations; a missing one raises with what to install."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def venv_python(what: str, configured: str | None, env: str, defaults: list[Path], install: str) -> Path:
    """The first existing of `configured`, $`env` (where set) or else `defaults`; FileNotFoundError naming
    them and `install` (how to get one) otherwise."""
    given = [Path(p) for p in (configured, os.environ.get(env)) if p]
    candidates = given or defaults
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(f"no {what} Python at {', '.join(map(str, candidates))}: {install}")
