"""The layers import one way only: kernels <- core (adaflash/) <- pipelines | trainer | server <- experiments <- cli.

Every import statement in the project's packages (module level and inside functions alike) is read from
the source, so a lazy import that runs the wrong way fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# source folder -> layer; `adaflash.<sub>` names the same layer when <sub> is one of these folders
FOLDERS = {
    "kernels": "kernels",
    "adaflash": "core",
    "pipelines": "pipelines",
    "trainer": "trainer",
    "server": "server",
    "experiments": "experiments",
    "cli": "cli",
}
ALLOWED = {  # layer -> the layers it may import
    "kernels": {"kernels"},
    "core": {"core", "kernels"},
    "pipelines": {"pipelines", "core", "kernels"},
    "trainer": {"trainer", "core", "kernels"},
    "server": {"server", "core", "kernels"},
    "experiments": {"experiments", "pipelines", "trainer", "server", "core", "kernels"},
    "cli": set(FOLDERS.values()),
}


def layer_of(module: str) -> str | None:
    """'adaflash.server.app' -> 'server', 'adaflash.engine' -> 'core', anything outside the project -> None."""
    parts = module.split(".")
    if parts[0] != "adaflash":
        return None
    if len(parts) > 1 and parts[1] in FOLDERS and parts[1] != "adaflash":
        return FOLDERS[parts[1]]
    return "core"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a source file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; write the absolute adaflash.* name"
            # `from adaflash import buffer` imports a module of the core; `from adaflash.x import y` imports x
            found += [(node.lineno, f"{node.module}.{a.name}" if node.module == "adaflash" else node.module) for a in node.names]
    return found


def sources() -> list[tuple[str, Path]]:
    return [(layer, p) for folder, layer in FOLDERS.items() for p in sorted((ROOT / folder).rglob("*.py"))]


def test_every_installed_package_has_a_layer():
    """The folders pyproject installs are exactly the folders given a layer here."""
    import tomllib

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(dirs.values()) == set(FOLDERS), "a package folder without a layer (or a layer without a folder): update FOLDERS"
    assert all(layer_of(name) == FOLDERS[folder] for name, folder in dirs.items())
    assert len(sources()) > 50


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_run_down_the_layers(layer):
    wrong = []
    for src_layer, path in sources():
        if src_layer != layer:
            continue
        for line, module in imports(path):
            dst = layer_of(module)
            if dst is not None and dst not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({layer} -> {dst})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_checker_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from adaflash.server.app import create_app\n")
    assert imports(bad) == [(2, "adaflash.server.app")]
    assert layer_of("adaflash.server.app") not in ALLOWED["core"]
    assert layer_of("adaflash.kernels.opd") == "kernels" and layer_of("adaflash.buffer.writer") == "core"


@pytest.mark.parametrize("installed", [True, False])
def test_the_checkout_kernels_folder_does_not_shadow_an_installed_kernels_package(tmp_path, installed):
    """transformers imports Hugging Face's top-level `kernels`; run from the checkout's root (as `python -m pytest`
    is), `import kernels` must give that package where it is installed (transformers 5.25 imports it when it loads),
    and where it is not, an empty package without a version (transformers up to 5.24 imports a package it finds no
    metadata for, and would fail on an ImportError)."""
    import subprocess
    import sys

    site = tmp_path / "site"
    if installed:
        (site / "kernels").mkdir(parents=True)
        (site / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    code = (
        f"import sys; sys.path.append({str(site)!r})\n"
        "import kernels; print(getattr(kernels, 'WHO', 'empty'), getattr(kernels, '__version__', None))\n"
        "import adaflash.kernels.cpu_build, os; print(os.path.dirname(adaflash.kernels.cpu_build.__file__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == ("installed None" if installed else "empty None"), out
    assert Path(out[1]) == ROOT / "kernels"
