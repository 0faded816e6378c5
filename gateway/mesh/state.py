"""The mesh client side's app keys: the objects the app's start-up builds once per process and
every request shares."""

from __future__ import annotations

from aiohttp import web

from gateway.mesh.client import MeshClient
from gateway.mesh.reasoning_formats import ReasoningFormats
from infermesh.prompt_tokens import PromptTokens

MESH = web.AppKey[MeshClient]("mesh")
# None: [router] prompt_tokens = false
PROMPT_TOKENS = web.AppKey[PromptTokens | None]("prompt_tokens")
REASONING_FORMATS = web.AppKey[ReasoningFormats]("reasoning_formats")
