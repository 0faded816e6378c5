"""Anthropic's Messages API: the handler, its wire format and context editing."""
