"""docs/CONFIGURATION.md is generated from the config dataclasses and kept in step with them."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from devtools.config_reference import (
    SERVICES,
    UndescribedKeyError,
    field_comments,
    reference,
    section_table,
)

_DOC = Path(__file__).resolve().parent.parent / "docs" / "CONFIGURATION.md"


def test_the_committed_reference_is_what_the_dataclasses_generate() -> None:
    assert _DOC.read_text() == reference(), (
        "docs/CONFIGURATION.md is stale: run `python -m devtools.config_reference`"
    )


def test_every_key_of_every_service_is_in_the_reference_with_its_variable() -> None:
    text = reference()
    for _, config_cls, env_prefix, _ in SERVICES:
        for name, section_cls in typing.get_type_hints(config_cls).items():
            assert f"### `[{name}]`" in text
            for field in dataclasses.fields(section_cls):
                assert f"`{env_prefix}_{name}_{field.name}`".upper() in text.upper()


def test_a_fields_comment_is_the_lines_just_above_it() -> None:
    @dataclasses.dataclass
    class Made:
        plain: int = 1
        # why this one
        # matters
        commented: str = "x"

        def method(self) -> None:
            # not a field's
            return None

    assert field_comments(Made) == {"plain": "", "commented": "why this one matters"}


def test_a_fields_comment_on_its_own_lines_follows_the_lines_above() -> None:
    @dataclasses.dataclass
    class Made:
        inline: int = 1  # said beside it
        # above
        both: tuple[int, ...] = (
            1,  # and inside
        )

    assert field_comments(Made) == {"inline": "said beside it", "both": "above and inside"}


def test_a_key_without_a_description_fails_the_reference_naming_it() -> None:
    @dataclasses.dataclass
    class Section:
        # described
        fine: int = 1
        bare: str = ""

    with pytest.raises(UndescribedKeyError, match=r"\[made\] bare .*has no description"):
        section_table("made", Section, "INFERMESH_TEST")
