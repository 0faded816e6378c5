"""A request of the shape Claude Code sends (observed on the wire from claude-cli 2.1): its headers
and betas, system blocks with cache_control, a system turn among the messages, a dozen tools whose
schemas use the keywords Claude Code's do (``propertyNames`` among them, which the grammar cannot
enforce), adaptive thinking with its display omitted, context_management, output_config.effort,
metadata.user_id and a large max_tokens. The texts are this project's own."""

from __future__ import annotations

import json
from typing import Any

BETAS = [
    "claude-code-20250219",
    "context-1m-2025-08-07",
    "interleaved-thinking-2025-05-14",
    "context-management-2025-06-27",
    "mid-conversation-system-2026-04-07",
    "effort-2025-11-24",
]
SESSION_ID = "2195a0db-47e6-4b86-831d-303172f5af9d"
_DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def _tool(
    name: str, description: str, properties: dict[str, Any], *required: str
) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "input_schema": {
            "$schema": _DRAFT_07,
            "type": "object",
            "properties": properties,
            "required": list(required),
            "additionalProperties": False,
        },
    }


_TEXT = {"type": "string"}
_PATH = {"type": "string", "description": "The absolute path of the file"}
TOOLS = [
    _tool(
        "Bash",
        "Runs a shell command and returns its output.",
        {
            "command": {"type": "string", "description": "The command to run"},
            "timeout": {"type": "number", "maximum": 600000, "description": "In milliseconds"},
            "run_in_background": {"type": "boolean"},
        },
        "command",
    ),
    _tool(
        "Read",
        "Reads a file, optionally a range of its lines.",
        {
            "file_path": _PATH,
            "offset": {"type": "integer", "minimum": 0},
            "limit": {"type": "integer", "exclusiveMinimum": 0},
        },
        "file_path",
    ),
    _tool(
        "Write",
        "Writes a file.",
        {"file_path": _PATH, "content": _TEXT},
        "file_path",
        "content",
    ),
    _tool(
        "Edit",
        "Replaces text in a file.",
        {
            "file_path": _PATH,
            "old_string": _TEXT,
            "new_string": _TEXT,
            "replace_all": {"type": "boolean", "default": False},
        },
        "file_path",
        "old_string",
        "new_string",
    ),
    _tool(
        "Glob",
        "Finds files by a glob pattern.",
        {"pattern": _TEXT, "path": _TEXT},
        "pattern",
    ),
    _tool(
        "Grep",
        "Searches file contents with a regular expression.",
        {
            "pattern": _TEXT,
            "path": _TEXT,
            "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
        },
        "pattern",
    ),
    _tool(
        "TaskCreate",
        "Creates a task on the task list.",
        {
            "subject": {"type": "string", "minLength": 1},
            "description": _TEXT,
            "metadata": {
                "type": "object",
                "propertyNames": {"type": "string", "maxLength": 32},
                "additionalProperties": {},
            },
        },
        "subject",
    ),
    _tool(
        "TaskUpdate",
        "Updates a task.",
        {
            "taskId": _TEXT,
            "status": {
                "anyOf": [{"type": "string", "enum": ["pending", "done"]}, {"const": "deleted"}]
            },
            "addBlockedBy": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        },
        "taskId",
    ),
    _tool("TaskList", "Lists the tasks.", {}),
    _tool(
        "WebFetch",
        "Fetches a URL and answers a question about it.",
        {"url": {"type": "string", "format": "uri"}, "prompt": _TEXT},
        "url",
        "prompt",
    ),
    _tool(
        "WebSearch",
        "Searches the web.",
        {
            "query": {"type": "string", "minLength": 2},
            "allowed_domains": {"type": "array", "items": {"type": "string"}},
        },
        "query",
    ),
    _tool("Skill", "Runs a skill.", {"skill": _TEXT}, "skill"),
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}

_GUIDE = (
    "You are a coding agent working in the user's repository. Read before you edit, keep changes "
    "small, run the tests you touch, and report what you changed. Use the tools for every file "
    "and shell operation; never invent a file's content. "
) * 2


def request(model: str, **changes: Any) -> dict[str, Any]:
    """Keyword arguments for the anthropic SDK's ``beta.messages`` calls, as Claude Code sends
    them (``betas`` puts ``?beta=true`` on the URL and the list in ``anthropic-beta``)."""
    return {
        "model": model,
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "x-client-header: cc_version=2.1; cc_entrypoint=cli;"},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": _GUIDE, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<reminder>Today is Monday.</reminder>\n"},
                    {
                        "type": "text",
                        "text": "list the files here",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
            {"role": "system", "content": "Agent types: general (every tool)."},
        ],
        "tools": TOOLS,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": json.dumps({"device_id": "d0", "session_id": SESSION_ID})},
        "betas": BETAS,
        "extra_headers": {"X-Claude-Code-Session-Id": SESSION_ID, "x-app": "cli"},
        **changes,
    }
