"""Checks a Responses object or stream event against the Open Responses OpenAPI document's
schemas (vendored in tests/gateway/schemas/openresponses.json, with their source noted there)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from openapi_schema_validator import OAS31Validator
from referencing import Registry, Resource

_DOCUMENT = Path(__file__).parent.parent / "gateway" / "schemas" / "openresponses.json"
_URI = "urn:openresponses"


@functools.cache
def _registry() -> Registry:
    document = json.loads(_DOCUMENT.read_text())
    return Registry().with_resource(_URI, Resource.opaque(document))


@functools.cache
def _event_schemas() -> dict[str, str]:
    """Each stream event's ``type`` to the name of its schema."""
    document = _registry().contents(_URI)
    names = [ref["$ref"].rsplit("/", 1)[1] for ref in document["stream_event"]["oneOf"]]
    schemas = document["components"]["schemas"]
    return {schemas[name]["properties"]["type"]["enum"][0]: name for name in names}


def _validate(instance: dict[str, Any], schema_name: str) -> None:
    schema = {"$ref": f"{_URI}#/components/schemas/{schema_name}"}
    OAS31Validator(schema, registry=_registry()).validate(instance)


def validate_response(response: dict[str, Any]) -> None:
    """Raises jsonschema's ValidationError where ``response`` is not a ResponseResource."""
    _validate(response, "ResponseResource")


def validate_event(event: dict[str, Any]) -> None:
    """Raises where ``event`` is not the stream event its ``type`` names (or names none)."""
    assert event["type"] in _event_schemas(), f"no stream event is named {event['type']!r}"
    _validate(event, _event_schemas()[event["type"]])
