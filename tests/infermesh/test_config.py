from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from gateway.config import GatewayConfig
from infermesh.config import ConfigError, env_names, load_config, section


@section
class _Server:
    host: str = "127.0.0.1"
    port: int = 8000
    ratio: float = 0.5
    debug: bool = False
    tags: list[str] = dataclasses.field(default_factory=list)
    sizes: list[int] = dataclasses.field(default_factory=list)
    path: str | None = None
    mode: Literal["fast", "safe"] = "fast"
    timeout_s: float = 1.0

    RENAMED = {"timeout_ms": "timeout_s (seconds)"}
    REMOVED = {"legacy": "it did nothing"}


@dataclasses.dataclass(frozen=True)
class _Config:
    server: _Server


def test_defaults_then_file_then_environment(tmp_path):
    path = tmp_path / "svc.toml"
    path.write_text('[server]\nport = 9000\nratio = 1\ntags = ["a"]\nsizes = [4, 1]\n')
    config = load_config(
        _Config,
        path,
        "svc",
        environ={
            "SVC_SERVER_HOST": "0.0.0.0",
            "SVC_SERVER_DEBUG": "true",
            "SVC_SERVER_TAGS": "x, y",
        },
    )
    assert config.server == _Server(
        host="0.0.0.0", port=9000, ratio=1.0, debug=True, tags=["x", "y"], sizes=[4, 1]
    )
    from_env = load_config(_Config, None, "svc", environ={"SVC_SERVER_SIZES": "1, 8,64"})
    assert from_env.server.sizes == [1, 8, 64]


@pytest.mark.parametrize(
    "text, message",
    [
        ('[server]\nport = "x"\n', "[server] port: expected int, got str 'x'"),
        ("[server]\nprot = 1\n", "[server] prot: unknown key"),
        ("[srv]\n", "unknown section [srv]"),
        ('[server]\nsizes = [1, "8"]\n', "[server] sizes: expected a list of ints, got [1, '8']"),
        ("[server]\nsizes = [true]\n", "[server] sizes: expected a list of ints"),
        ('[server]\nmode = "slow"\n', "[server] mode: expected one of fast, safe, got 'slow'"),
        (
            "[server]\ntimeout_ms = 500\n",
            "[server] timeout_ms: timeout_ms was renamed timeout_s (seconds)",
        ),
        ("[server]\nlegacy = true\n", "[server] legacy: legacy was removed: it did nothing"),
        ("[server\n", "invalid TOML"),
    ],
)
def test_file_errors_name_file_and_key(tmp_path, text, message):
    path = tmp_path / "svc.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(_Config, path, "svc", environ={})
    assert str(path) in str(e.value) and message in str(e.value)


def test_environment_errors_name_variable():
    with pytest.raises(ConfigError, match="SVC_SERVER_PORT: expected int, got 'abc'"):
        load_config(_Config, None, "svc", environ={"SVC_SERVER_PORT": "abc"})
    with pytest.raises(ConfigError, match="SVC_SERVER_SIZES: expected integers, comma-separated"):
        load_config(_Config, None, "svc", environ={"SVC_SERVER_SIZES": "1,two"})
    with pytest.raises(ConfigError, match="SVC_SERVER_DEBUG: expected a boolean"):
        load_config(_Config, None, "svc", environ={"SVC_SERVER_DEBUG": "maybe"})
    with pytest.raises(
        ConfigError, match="SVC_SERVER_MODE: expected one of fast, safe, got 'slow'"
    ):
        load_config(_Config, None, "svc", environ={"SVC_SERVER_MODE": "slow"})
    with pytest.raises(
        ConfigError, match="SVC_SERVER_TIMEOUT_MS: timeout_ms was renamed timeout_s"
    ):
        load_config(_Config, None, "svc", environ={"SVC_SERVER_TIMEOUT_MS": "500"})
    with pytest.raises(ConfigError, match="SVC_SERVER_LEGACY: legacy was removed: it did nothing"):
        load_config(_Config, None, "svc", environ={"SVC_SERVER_LEGACY": "true"})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(_Config, tmp_path / "nope.toml", "svc", environ={})


def test_env_names_cover_every_key():
    assert env_names(_Config, "svc") == {
        f"SVC_SERVER_{k}"
        for k in ("HOST", "PORT", "RATIO", "DEBUG", "TAGS", "SIZES", "PATH", "MODE", "TIMEOUT_S")
    }


@pytest.mark.parametrize("key", ["relay", "streams"])
def test_the_gateways_removed_router_keys_name_file_and_key(tmp_path, key):
    path = tmp_path / "gateway.toml"
    path.write_text(f"[router]\n{key} = true\n")
    with pytest.raises(ConfigError) as e:
        load_config(GatewayConfig, path, "infermesh_gateway", environ={})
    assert f"{path}: [router] {key}: {key} was removed" in str(e.value)
