"""The simulated tokenization: 4 UTF-8 bytes a token, little-endian, the last group padded."""

from __future__ import annotations

import pytest

from infermesh.sim_tokens import prompt_text, sim_token_ids


def test_each_four_bytes_are_one_little_endian_id_and_a_partial_group_is_padded():
    assert sim_token_ids("abcd") == [0x64636261]
    assert sim_token_ids("abcdef") == [0x64636261, 0x6665]
    assert sim_token_ids("") == []
    assert len(sim_token_ids("é" * 3)) == 2  # 6 bytes of UTF-8


def test_chat_turns_render_as_role_lines_and_a_prompt_as_itself():
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_text(turns, None) == "<|system|>be brief\n<|user|>hi\n"
    assert prompt_text(None, "raw") == "raw"
    with pytest.raises(ValueError, match="messages or prompt"):
        prompt_text(None, None)
