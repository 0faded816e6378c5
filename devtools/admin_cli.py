"""``python -m infermesh keys ...``: the admin API (``gateway.accounts.admin``) from a shell.

The gateway is found at ``INFERMESH_ADMIN_URL`` (default http://127.0.0.1:8000) and
the admin token is read from ``INFERMESH_ADMIN_TOKEN`` only, never from the
command line, where other users could read it. Answers are printed as JSON; a
created or rotated key's plaintext is in its ``key`` field, shown this once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from gateway.accounts.keys import LIMIT_FIELDS
from infermesh.redact import redact_url

_DEFAULT_URL = "http://127.0.0.1:8000"
_TIMEOUT_S = 10.0


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``keys`` and its actions to the ``python -m infermesh`` parser."""
    keys = commands.add_parser(
        "keys",
        help="manage API keys through the gateway's admin API "
        "(INFERMESH_ADMIN_URL, INFERMESH_ADMIN_TOKEN)",
    )
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a key; its plaintext is shown once")
    create.add_argument("name")
    _add_settings(create, clearable=False)
    actions.add_parser("list", help="every key, without plaintexts")
    for action, text in [
        ("get", "one key's settings"),
        ("disable", "disable a key"),
        ("revoke", "revoke a key for good"),
        ("rotate", "a new key with the same settings; revokes the old one"),
    ]:
        actions.add_parser(action, help=text).add_argument("id")
    update = actions.add_parser("update", help="change settings; 'none' clears a limit")
    update.add_argument("id")
    update.add_argument("--name")
    update.add_argument("--enable", action="store_true", help="enable a disabled key again")
    _add_settings(update, clearable=True)
    usage = actions.add_parser("usage", help="requests and tokens used")
    usage.add_argument("id")
    usage.add_argument("--days", type=int, default=7, help="per-day figures for this many days")


def _add_settings(parser: argparse.ArgumentParser, clearable: bool) -> None:
    # Absent flags stay absent (SUPPRESS), so an update sends only what was given.
    value = _int_or_none if clearable else int
    for flag in LIMIT_FIELDS:
        parser.add_argument(
            f"--{flag.replace('_', '-')}", dest=flag, type=value, default=argparse.SUPPRESS
        )
    parser.add_argument(
        "--models",
        type=_models_or_none if clearable else _models,
        default=argparse.SUPPRESS,
        help="comma-separated models the key may use (default: all)",
    )
    parser.add_argument(
        "--expires-at",
        dest="expires_at",
        type=value,
        default=argparse.SUPPRESS,
        help="unix seconds",
    )


def _int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _models(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def _models_or_none(text: str) -> list[str] | None:
    return None if text.lower() == "none" else _models(text)


def run(args: argparse.Namespace) -> int:
    """Runs one ``keys`` action; prints the answer, or the error on stderr (exit 1)."""
    settings = {
        f: getattr(args, f) for f in (*LIMIT_FIELDS, "models", "expires_at") if hasattr(args, f)
    }
    kid = getattr(args, "id", "")
    call: tuple[str, str, dict[str, Any] | None]
    if args.action == "create":
        call = ("POST", "/admin/keys", {"name": args.name, **settings})
    elif args.action == "list":
        call = ("GET", "/admin/keys", None)
    elif args.action == "get":
        call = ("GET", f"/admin/keys/{kid}", None)
    elif args.action == "update":
        if args.name is not None:
            settings["name"] = args.name
        if args.enable:
            settings["disabled"] = False
        call = ("PATCH", f"/admin/keys/{kid}", settings)
    elif args.action == "usage":
        call = ("GET", f"/admin/keys/{kid}/usage?days={args.days}", None)
    else:  # disable, revoke, rotate
        call = ("POST", f"/admin/keys/{kid}/{args.action}", {})
    try:
        print(json.dumps(_request(*call), indent=2))
    except _CallFailed as e:
        print(f"infermesh keys {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


class _CallFailed(Exception):
    pass


def _request(method: str, path: str, body: dict[str, Any] | None) -> Any:
    token = os.environ.get("INFERMESH_ADMIN_TOKEN")
    if not token:
        raise _CallFailed("set INFERMESH_ADMIN_TOKEN to the gateway's admin token")
    url = os.environ.get("INFERMESH_ADMIN_URL", _DEFAULT_URL).rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise _CallFailed(f"{e.code} {message}") from None
    except urllib.error.URLError as e:
        raise _CallFailed(f"cannot reach the gateway at {redact_url(url)}: {e.reason}") from None
