"""The default model `make run` serves: a tiny DeepSeek-V3 trained on templated dialogues
(corpus.py) by train.py, stored in checkpoint/ and copied by `make model` to SERVED_PATH; and its
thinking variant, which thinks briefly when asked, in thinking/ and THINKING_SERVED_PATH."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT = Path(__file__).parent / "checkpoint"
# where `make model` puts it; the directory's name is the model's name in the API
SERVED_PATH = "models/tiny-deepseek-v3-chat"
THINKING_CHECKPOINT = Path(__file__).parent / "thinking"
THINKING_SERVED_PATH = "models/tiny-deepseek-v3-chat-thinking"
