"""``python -m gateway`` as the mesh runs it: a process configured by environment."""

from __future__ import annotations

import signal
import urllib.request

import psutil

from infermesh.ports import free_port
from tests.helpers.gateway import gateway_process


def test_serves_on_the_configured_port_and_stops_on_sigterm(redis_server):
    port = free_port()
    proc = gateway_process(
        {
            "INFERMESH_GATEWAY_SERVER_PORT": str(port),
            "INFERMESH_GATEWAY_REDIS_URL": redis_server.url,
            "INFERMESH_GATEWAY_ROUTER_ADDRESS": f"127.0.0.1:{free_port()}",
        }
    )
    try:
        line = proc.stdout.readline()
        while line and "listening" not in line:
            line = proc.stdout.readline()
        assert f"gateway listening on http://127.0.0.1:{port}/v1" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_config_errors_exit_2_naming_the_key(tmp_path):
    proc = gateway_process({"INFERMESH_GATEWAY_SERVER_PORT": "eighty"})
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "INFERMESH_GATEWAY_SERVER_PORT" in out

    config = tmp_path / "gateway.toml"
    config.write_text("[router]\nadress = 'x'\n")
    proc = gateway_process({"INFERMESH_GATEWAY_CONFIG": str(config)})
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "adress: unknown key" in out

    proc = gateway_process({}, "--config", str(tmp_path / "missing.toml"))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "config file not found" in out


def test_without_tls_files_or_plaintext_it_exits_2_naming_the_file_and_key(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text("[tls]\nkey_file = 'gateway.key'\n")
    proc = gateway_process(
        {"INFERMESH_GATEWAY_CONFIG": str(config), "INFERMESH_GATEWAY_TLS_PLAINTEXT": "false"}
    )
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert f"{config}: [tls] cert_file: TLS is required but no cert_file is set" in out
    assert "INFERMESH_GATEWAY_TLS_" in out and "Traceback" not in out


def test_processes_share_the_port_and_stop_together(redis_server):
    port = free_port()
    proc = gateway_process(
        {
            "INFERMESH_GATEWAY_SERVER_PORT": str(port),
            "INFERMESH_GATEWAY_SERVER_PROCESSES": "2",
            "INFERMESH_GATEWAY_REDIS_URL": redis_server.url,
            "INFERMESH_GATEWAY_ROUTER_ADDRESS": f"127.0.0.1:{free_port()}",
        }
    )
    try:
        listening = 0
        while listening < 2:  # both write to the one stdout
            line = proc.stdout.readline()
            assert line, "a gateway process ended before listening"
            listening += f"gateway listening on http://127.0.0.1:{port}/v1" in line
        siblings = psutil.Process(proc.pid).children()
        assert len(siblings) == 1
        for _ in range(4):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not siblings[0].is_running()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
