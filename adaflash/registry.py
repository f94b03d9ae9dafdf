"""Drafter versions in the MLflow model registry: the client that serving and training share.

The tracking server itself is started by `adaflash.pipelines.mlflow_server` (or by compose); the
serving side's poller that hot-swaps from the registry is `adaflash.server.swap.HotSwapper`.

- `Registry`: register a drafter directory as a model version (files logged under `drafter/` of an
  MLflow run, version created from `runs:/<run>/drafter`), read / move the `champion` alias, list
  versions, download a version (safetensors + JSON only, cached per version). Every call retries
  connection failures with exponential backoff, then raises `RegistryUnavailable`. `resolve` turns a
  version number or an alias into a version.
- `bootstrap`: the first drafter becomes version 1 and champion; later calls return the champion.

A downloaded version is a drafter directory: load it with `adaflash.drafter.load_drafter_and_head`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("adaflash.registry")

CHAMPION = "champion"
EXPERIMENT = "adaflash"
ARTIFACT_PATH = "drafter"
DOWNLOAD_SUFFIXES = (".safetensors", ".json")  # what a server ever loads: no pickles
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt")  # never registered


# ----------------------------------------------------------------------------- the registry client
class RegistryUnavailable(RuntimeError):
    """The MLflow server did not answer after all retries."""


def _transient(e: BaseException) -> bool:
    """Connection refused / reset / timeout or 502-504 anywhere in the exception chain."""
    import requests

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError, TimeoutError)):
            return True
        if getattr(e, "error_code", None) == "TEMPORARILY_UNAVAILABLE":
            return True
        if type(e).__name__ == "RestException" and e.get_http_status_code() in (502, 503, 504):
            return True
        e = e.__cause__ or e.__context__
    return False


def _root(e: BaseException) -> str:
    """'ConnectionRefusedError' rather than the MlflowException wrapping it."""
    for _ in range(16):  # chains are short; the bound guards against cycles
        if (e.__cause__ or e.__context__) is None:
            break
        e = e.__cause__ or e.__context__
    return type(e).__name__


def target_label(identity: dict) -> str:
    """A drafter's target identity as one readable registry tag (the UI shows tags as plain text)."""
    rest = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(identity.items()) if k not in ("name", "fingerprint"))
    return f"{identity.get('name', '?')} ({identity.get('fingerprint', '?')}" + (f"; {rest})" if rest else ")")


class Registry:
    """The drafter's registered model on an MLflow tracking server."""

    def __init__(self, tracking_uri: str, model_name: str = "adaflash-drafter", retries: int = 5, backoff_s: float = 0.5):
        # This class owns retries: MLflow's own (7, exponential) would stall a dead-server call for minutes.
        # Process-wide: other MLflow calls in this process should go through `call` to keep retrying.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from mlflow import MlflowClient

        self.tracking_uri, self.model_name = tracking_uri, model_name
        self.retries, self.backoff_s = retries, backoff_s
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def call(self, what: str, fn: Callable):
        """fn() with this registry's retries: connection failures are retried with exponential backoff
        (each retry logged), then RegistryUnavailable. Also for callers' own MLflow calls (e.g.
        `registry.call("log metrics", lambda: registry.client.log_metric(...))`)."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:
                if not _transient(e):
                    raise
                if attempt == self.retries:
                    raise RegistryUnavailable(
                        f"MLflow at {self.tracking_uri} unreachable after {attempt + 1} attempts ({what}): start it "
                        f"with `adaflash mlflow` or fix the tracking URI"
                    ) from e
                delay = self.backoff_s * 2**attempt
                log.warning(
                    "MLflow at %s unreachable (%s: %s); retry %d/%d in %.2f s",
                    self.tracking_uri,
                    what,
                    _root(e),
                    attempt + 1,
                    self.retries,
                    delay,
                )
                time.sleep(delay)

    @staticmethod
    def _missing(e: Exception) -> bool:
        code = getattr(e, "error_code", None)
        return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and "not found" in str(e))

    def _experiment_id(self) -> str:
        exp = self.call("get experiment", lambda: self.client.get_experiment_by_name(EXPERIMENT))
        if exp is not None:
            return exp.experiment_id
        try:
            return self.call("create experiment", lambda: self.client.create_experiment(EXPERIMENT))
        except Exception as e:  # created meanwhile by another process
            if getattr(e, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.call("get experiment", lambda: self.client.get_experiment_by_name(EXPERIMENT)).experiment_id

    def _ensure_model(self) -> None:
        try:
            self.call("get model", lambda: self.client.get_registered_model(self.model_name))
        except Exception as e:
            if not self._missing(e):
                raise
            try:
                self.call(
                    "create model",
                    lambda: self.client.create_registered_model(
                        self.model_name, description="AdaFlash block drafter; alias `champion` is what servers load"
                    ),
                )
            except Exception as e2:
                if getattr(e2, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                    raise

    def register(self, drafter_dir: str | Path, *, run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        """Log the drafter directory's files under `drafter/` of run `run_id` (a new run in experiment
        'adaflash' if None) and create a model version from it; -> the version string."""
        drafter_dir = Path(drafter_dir)
        cfg_path = drafter_dir / "config.json"
        if not cfg_path.exists() or not (drafter_dir / "model.safetensors").exists():
            raise FileNotFoundError(f"{drafter_dir} is not a drafter directory (needs config.json and model.safetensors)")
        identity = json.loads(cfg_path.read_text()).get("target")
        if not identity:
            raise ValueError(f"{cfg_path} records no target identity ('target'): save drafters with Drafter.save")
        files = []
        for f in sorted(p for p in drafter_dir.rglob("*") if p.is_file()):
            if f.suffix in PICKLE_SUFFIXES:
                log.warning("not registering %s: pickle-format files are never loaded by servers", f)
            else:
                files.append(f)
        own_run = run_id is None
        if own_run:
            exp = self._experiment_id()
            run_id = self.call(
                "create run", lambda: self.client.create_run(exp, tags={"mlflow.runName": f"register-{drafter_dir.name}"}).info.run_id
            )
        for f in files:
            rel = f.relative_to(drafter_dir).parent
            dest = ARTIFACT_PATH if rel == Path(".") else f"{ARTIFACT_PATH}/{rel.as_posix()}"
            self.call(f"upload {f.name}", lambda f=f, dest=dest: self.client.log_artifact(run_id, str(f), dest))
        if own_run:
            self.call("end run", lambda: self.client.set_terminated(run_id))
        self._ensure_model()
        all_tags = {k: str(v) for k, v in (tags or {}).items()}
        all_tags["target"] = target_label(identity)
        mv = self.call(
            "create version",
            lambda: self.client.create_model_version(self.model_name, f"runs:/{run_id}/{ARTIFACT_PATH}", run_id=run_id, tags=all_tags),
        )
        log.info("registered %s as %s version %s (run %s)", drafter_dir, self.model_name, mv.version, run_id)
        return str(mv.version)

    def alias_version(self, alias: str) -> str | None:
        """The version behind `alias`; None when there is no such alias or no model yet."""
        try:
            mv = self.call(f"read alias {alias}", lambda: self.client.get_model_version_by_alias(self.model_name, alias))
        except Exception as e:
            if self._missing(e):
                return None
            raise
        return str(mv.version)

    def champion(self) -> str | None:
        """The version behind alias `champion`; None when there is no alias or no model yet."""
        return self.alias_version(CHAMPION)

    def resolve(self, ref: str) -> str:
        """A version number ("3") or an alias ("champion") -> the version; ValueError naming what exists."""
        rows = self.versions()
        if ref.isdigit() and any(r["version"] == ref for r in rows):
            return ref
        version = None if ref.isdigit() else self.alias_version(ref)
        if version is not None:
            return version
        aliases = sorted({a for r in rows for a in r["aliases"]})
        raise ValueError(
            f"{self.model_name} at {self.tracking_uri} has no version or alias {ref!r} (versions: "
            f"{', '.join(r['version'] for r in rows) or 'none'}; aliases: {', '.join(aliases) or 'none'})"
        )

    def set_champion(self, version: str) -> None:
        """Point `champion` at `version` (servers swap to it on their next poll; an older one = rollback)."""
        self.call("set champion", lambda: self.client.set_registered_model_alias(self.model_name, CHAMPION, str(version)))
        log.info("%s@%s -> version %s", self.model_name, CHAMPION, version)

    def tag_version(self, version: str, key: str, value: str) -> None:
        self.call("tag version", lambda: self.client.set_model_version_tag(self.model_name, str(version), key, str(value)))

    def versions(self) -> list[dict]:
        """[{version, tags, aliases, run_id, created_ms}] in version order; [] when the model does not exist."""
        try:
            model = self.call("get model", lambda: self.client.get_registered_model(self.model_name))
        except Exception as e:
            if self._missing(e):
                return []
            raise
        found = self.call("list versions", lambda: self.client.search_model_versions(f"name='{self.model_name}'"))
        aliases: dict[str, list[str]] = {}
        for alias, v in (model.aliases or {}).items():
            aliases.setdefault(str(v), []).append(alias)
        rows = [
            {
                "version": str(mv.version),
                "tags": dict(mv.tags or {}),
                "aliases": sorted(aliases.get(str(mv.version), [])),
                "run_id": mv.run_id,
                "created_ms": mv.creation_timestamp,
            }
            for mv in found
        ]
        return sorted(rows, key=lambda r: int(r["version"]))

    def download(self, version: str, dest_root: str | Path) -> Path:
        """Local directory with the version's safetensors + JSON files; cached (versions are immutable)."""
        from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

        dest = Path(dest_root) / f"{self.model_name}-v{version}"
        if (dest / "config.json").exists() and (dest / "model.safetensors").exists():
            return dest
        mv = self.call("get version", lambda: self.client.get_model_version(self.model_name, str(version)))
        if not str(mv.source).startswith("runs:/"):
            raise ValueError(
                f"{self.model_name} version {version} comes from {mv.source}, not from Registry.register "
                f"(runs:/<run>/{ARTIFACT_PATH}): register drafters with `adaflash registry` or Registry.register"
            )
        run_id, path = RunsArtifactRepository.parse_runs_uri(mv.source)
        listing = self.call("list files", lambda: self.client.list_artifacts(run_id, path))
        tmp = Path(dest_root) / f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for f in listing:
                if not f.is_dir and f.path.endswith(DOWNLOAD_SUFFIXES):
                    self.call(f"download {f.path}", lambda f=f: self.client.download_artifacts(run_id, f.path, str(tmp)))
            if not (tmp / "config.json").exists() or not (tmp / "model.safetensors").exists():
                raise ValueError(f"{self.model_name} version {version} holds no drafter (config.json + model.safetensors)")
            try:
                os.replace(tmp, dest)
            except OSError:  # another thread/process finished the same version first
                if not (dest / "model.safetensors").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("downloaded %s version %s to %s", self.model_name, version, dest)
        return dest


def bootstrap(registry: Registry, drafter_dir: str | Path) -> str:
    """Registry without versions: register `drafter_dir` as the first version and make it champion.
    Otherwise -> the current champion (re-pointed at the first version if the alias was lost)."""
    rows = registry.versions()
    if not rows:
        version = registry.register(drafter_dir, tags={"source": "bootstrap"})
        registry.set_champion(version)
        return version
    champion = registry.champion()
    if champion is None:
        champion = rows[0]["version"]
        log.warning("%s has versions but no `%s` alias: pointing it at the first version %s", registry.model_name, CHAMPION, champion)
        registry.set_champion(champion)
    return champion
