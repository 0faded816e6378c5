"""Chat template and streaming detokenization on the tiny checkpoint's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.tiny_model import ASSISTANT, BOS, USER
from infermesh.text.tokenizer import Tokenizer
from worker_svc.decoding.detokenizer import IncrementalDetokenizer

_MULTIBYTE = "Hello 世界! 深度求索 🚀🎉👍🏽 naïve café — 한국어 Привет ok"


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_dir)


def _stream(
    tokenizer: Tokenizer, text: str, stop: tuple[str, ...] = ()
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for token in tokenizer.encode(text)[1:]:  # without BOS
        pieces.append(detok.add(token))
        if detok.stopped:
            break
    pieces.append(detok.flush())
    return pieces, detok


def test_chat_template_renders(tokenizer: Tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    rendered = tokenizer.render_chat(messages)
    assert (
        rendered
        == f"{BOS}Be brief.{USER}Hi{ASSISTANT}Hello<｜end▁of▁sentence｜>{USER}Again{ASSISTANT}"
    )
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids[-1] == tokenizer.hf.convert_tokens_to_ids(ASSISTANT)


def test_any_utf8_round_trips(tokenizer: Tokenizer):
    ids = tokenizer.encode(_MULTIBYTE)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == _MULTIBYTE


def test_incremental_equals_full_decode_without_replacement_chars(tokenizer: Tokenizer):
    ids = tokenizer.encode(_MULTIBYTE)
    assert len(ids) > 20  # multi-byte characters span several byte-level tokens
    pieces, _ = _stream(tokenizer, _MULTIBYTE)
    assert "".join(pieces) == _MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # partial characters were held back


def test_stop_string_is_never_emitted(tokenizer: Tokenizer):
    pieces, detok = _stream(tokenizer, "one two STOP three four", stop=("STOP",))
    assert "".join(pieces) == "one two "
    assert detok.stopped


def test_partial_stop_string_is_held_back_then_released(tokenizer: Tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ("world!",))
    out = ""
    for token in tokenizer.encode("hello wor")[1:]:
        out += detok.add(token)
    assert out == "hello "  # "wor" might start "world!"
    for token in tokenizer.encode("m")[1:]:
        out += detok.add(token)
    assert out == "hello worm"


def test_multibyte_stop_string(tokenizer: Tokenizer):
    pieces, detok = _stream(tokenizer, "abc 世界 🚀 rest", stop=("🚀",))
    assert "".join(pieces) == "abc 世界 "
    assert detok.stopped


def test_flush_releases_a_stop_prefix_at_the_end(tokenizer: Tokenizer):
    pieces, detok = _stream(tokenizer, "the end ST", stop=("STOP",))
    assert "".join(pieces) == "the end ST" and not detok.stopped
