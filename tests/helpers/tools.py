"""The tool schemas the OpenAI and Anthropic tool-calling tests both ask with."""

from __future__ import annotations

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["utc_offset"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]

# a few hundred constrained tokens: seconds on a quiet machine, much longer on a loaded one
SLOW_TIMEOUT_S = 100
