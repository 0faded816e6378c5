"""The OpenAI-compatible HTTP gateway: ``python -m gateway [--config PATH]``."""
