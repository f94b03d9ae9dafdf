"""The documented rollback, done as a person does it: in the MLflow UI, in a real (headless) Chromium driven by
playwright, `champion` is moved from version 2 back to version 1 by clicking through the version page's alias
dialog, and the serving node that polls the registry swaps back to version 1.

Chromium is Debian's package (`make browser`, a prerequisite of `make test`); playwright only drives it.
With ADAFLASH_UI_SCREENSHOT=docs/mlflow-ui-rollback.png the page with the filled-in dialog, just before Save,
is written to that file (the picture the README links)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests
from serve_util import running_server, serve_config, wait_version

from adaflash.registry import CHAMPION, Registry, bootstrap

CHROMIUM = os.environ.get("ADAFLASH_CHROMIUM", "/usr/bin/chromium")
# CI installs Chromium through `make test`, so there a missing browser fails instead of skipping
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not os.environ.get("CI"), reason=f"no Chromium at {CHROMIUM} (`make browser`)"
)

INTERVAL = 1.0  # the server's registry poll


def test_champion_moved_back_in_the_mlflow_ui_swaps_the_server(mlflow_server, tiny_hf_dir, tiny_drafter_dir, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    reg = Registry(mlflow_server, model_name="ui-rollback", retries=2, backoff_s=0.2)
    assert bootstrap(reg, tiny_drafter_dir) == "1"
    reg.set_champion(reg.register(tiny_drafter_dir, tags={"note": "the newer version"}))
    assert reg.champion() == "2"
    cfg = serve_config(
        tiny_hf_dir,
        tiny_drafter_dir,
        tmp_path / "buffer",
        registry={
            "tracking_uri": mlflow_server,
            "model_name": reg.model_name,
            "cache_dir": str(tmp_path / "cache"),
            "interval_s": INTERVAL,
            "retries": 2,
            "rollback": False,  # only the click may move champion here
        },
    )
    with running_server(cfg) as (url, _, _), sync_playwright() as pw:
        wait_version(url, "2", 30)
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 520})
            page.set_default_timeout(30_000)
            page.goto(f"{mlflow_server}/#/models/{reg.model_name}/versions/1")
            expect(page.get_by_role("heading", name="Version 1")).to_be_visible()
            assistant = page.get_by_role("button", name="Close")  # MLflow 3's assistant side panel: not needed, hides the page
            if assistant.count():
                assistant.first.click()
            page.get_by_title("Add aliases").click()
            dialog = page.get_by_role("dialog")
            expect(dialog.get_by_role("heading")).to_have_text("Add/Edit alias for model version 1")
            dialog.get_by_role("combobox").click()
            # the dropdown lists the existing alias with the version holding it (antd also keeps an invisible a11y copy)
            page.get_by_test_id("model-alias-option").filter(has_text=CHAMPION).filter(has_text="Version 2").click()
            expect(dialog).to_contain_text(f'The "{CHAMPION}" alias is also being used on version 2')
            if shot := os.environ.get("ADAFLASH_UI_SCREENSHOT"):
                Path(shot).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=shot)
            dialog.get_by_role("button", name="Save aliases").click()
            expect(dialog).to_be_hidden()
            expect(page.get_by_test_id("descriptions-item").filter(has_text="Aliases")).to_contain_text(CHAMPION)
        finally:
            browser.close()
        alias = requests.get(
            f"{mlflow_server}/api/2.0/mlflow/registered-models/alias", params={"name": reg.model_name, "alias": CHAMPION}, timeout=10
        )
        assert alias.json()["model_version"]["version"] == "1", alias.text  # the click really moved it in the registry
        wait_version(url, "1", 15)  # the next poll swaps; how soon is test_server_registry.py's business
        swapper = requests.get(f"{url}/v1/status", timeout=5).json()["registry"]
        assert swapper["swaps"] >= 2 and swapper["refused"] == 0  # to 2 at start, back to 1 after the click
