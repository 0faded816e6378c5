"""The default model's corpus (devtools.chat_model.corpus) keeps its evaluation honest: no value
or phrasing of a held-out request is in the training dialogues the stored recipe's seeds draw,
the tool cases need every tool and list it in every position equally often, the training values
are made up fresh per dialogue, and a training seed range that overlaps the evaluation's is
refused."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import pytest

from devtools.chat_model.corpus import (
    EVAL_SEEDS,
    EVAL_TOOLS,
    TOOL_KINDS,
    TRAINING_SEED,
    Dialogue,
    dialogues,
    eval_cases,
    held_out_phrasings,
    held_out_values,
)

# what a phrasing's field holds (others: anything), so that "{amount} {from_currency} to
# {to_currency}?" does not match "Can you count from 1 to 4?"
_FIELDS = {"a": r"\d+", "b": r"\d+", "amount": r"\d+", "minutes": r"\d+"} | {
    f"{side}_currency": "[A-Z]{3}" for side in ("from", "to")
}
# dialogues of the recipe's corpus checked: ~1 s to draw, every kind and every phrasing drawn
# many times over (the recipe draws 250,000 from the same seeds)
_SAMPLE = 20_000


@pytest.fixture(scope="module")
def training() -> list[Dialogue]:
    return dialogues(_SAMPLE, TRAINING_SEED)


def _texts(dialogue: Dialogue) -> Iterator[str]:
    """Every text of the dialogue the model reads or writes: contents, calls' arguments."""
    for message in dialogue.messages:
        yield message["content"] or ""
        for call in message.get("tool_calls", []):
            yield call["function"]["arguments"]


def _requests(dialogue: Dialogue) -> Iterator[str]:
    return (m["content"] for m in dialogue.messages if m["role"] in ("system", "user"))


def test_no_held_out_value_is_in_the_training_corpus(training):
    values = sorted(held_out_values(), key=len, reverse=True)
    assert len(values) > 50 and {"emma", "rome", "src/lib.rs"} <= set(values)
    held_out = re.compile(rf"(?<!\w)(?:{'|'.join(map(re.escape, values))})(?!\w)", re.IGNORECASE)
    leaks = [m.group() for d in training for text in _texts(d) if (m := held_out.search(text))]
    assert not leaks, Counter(leaks).most_common(10)


def test_no_held_out_phrasing_is_a_training_request(training):
    forms = held_out_phrasings()
    assert "Say my name." in forms and "Weather in {city}?" in forms
    pattern = re.compile(
        "|".join(
            "".join(
                re.escape(part) if i % 2 == 0 else _FIELDS.get(part, ".+")
                for i, part in enumerate(pieces)
            )
            for pieces in (re.split(r"\{(\w+)\}", form) for form in forms)
        ),
        re.DOTALL,
    )
    assert (
        pattern.fullmatch("Weather in Oslo?") and pattern.fullmatch("Convert 5 EUR to USD?") is None
    )
    leaks = [text for d in training for text in _requests(d) if pattern.fullmatch(text)]
    assert not leaks, Counter(leaks).most_common(10)


def test_the_tool_cases_need_each_tool_at_each_position_equally_often():
    cases = eval_cases("tool", 3 * len(TOOL_KINDS), seed=0)
    positions = Counter([t["function"]["name"] for t in c.tools].index(c.tool) for c in cases)
    assert positions == dict.fromkeys(range(EVAL_TOOLS), len(TOOL_KINDS))
    assert Counter(c.tool for c in cases) == {k.name: 3 for k in TOOL_KINDS}


def test_training_values_are_made_up_fresh_per_dialogue(training):
    told = [
        d.messages[-1]["content"]
        for d in training
        if d.kind == "recall" and d.messages[-2]["content"] in ("What is my name?", "Who am I?")
    ]
    assert len(told) > 150
    assert len(set(told)) > 0.6 * len(told), Counter(told).most_common(5)


def test_a_training_seed_range_that_overlaps_the_evaluations_is_refused():
    with pytest.raises(ValueError, match=rf"overlap the evaluation's seeds {EVAL_SEEDS.start}"):
        dialogues(10, EVAL_SEEDS.start - 5)
    assert len(dialogues(5, EVAL_SEEDS.start - 5)) == 5
    assert len(dialogues(5, EVAL_SEEDS.start, split="eval")) == 5
    with pytest.raises(ValueError, match="an evaluation seed is 0"):
        eval_cases("tool", 1, seed=-1)
