"""The serving node and the MLflow registry together (issue 5's rollback check): `adaflash serve`'s
app polls a real `mlflow server`; promoting version 2 swaps it in while requests keep succeeding,
and moving `champion` back to version 1 through MLflow's REST API (what the UI does) swaps back
within two poll intervals."""

from __future__ import annotations

import threading

import requests
from serve_util import running_server, serve_config, wait_version

from adaflash.registry import Registry, bootstrap

INTERVAL = 1.0


def test_server_swaps_on_promotion_and_back_on_rest_rollback(mlflow_server, tiny_hf_dir, tiny_drafter_dir, tmp_path):
    reg = Registry(mlflow_server, model_name="serve-rollback", retries=2, backoff_s=0.2)
    assert bootstrap(reg, tiny_drafter_dir) == "1"
    v2 = reg.register(tiny_drafter_dir, tags={"note": "same weights, new version"})
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
        },
    )
    with running_server(cfg) as (url, state, _):
        wait_version(url, "1", 30)  # the champion replaces the config's label on the first poll
        statuses, stop = [], threading.Event()

        def traffic():  # requests keep flowing through both swaps
            while not stop.is_set():
                r = requests.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Count: 1 2 3", "max_tokens": 8}, timeout=60)
                statuses.append(r.status_code)

        client = threading.Thread(target=traffic)
        client.start()
        try:
            reg.set_champion(v2)
            wait_version(url, v2, 30)
            r = requests.post(
                f"{mlflow_server}/api/2.0/mlflow/registered-models/alias",
                json={"name": reg.model_name, "alias": "champion", "version": "1"},
                timeout=10,
            )
            assert r.status_code == 200, r.text
            took = wait_version(url, "1", 10)
        finally:
            stop.set()
            client.join(60)
        assert took <= 2 * INTERVAL + 0.5, f"rollback took {took:.2f} s, more than two poll intervals"
        assert statuses and set(statuses) == {200}
        registry = requests.get(f"{url}/v1/status", timeout=5).json()["registry"]
        assert registry["swaps"] >= 3 and registry["refused"] == 0
        metrics = requests.get(f"{url}/metrics", timeout=5).text
        swaps = [line for line in metrics.splitlines() if line.startswith("adaflash_drafter_swaps")]
        assert swaps and float(swaps[-1].split()[-1]) >= 3
