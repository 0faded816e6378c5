"""What guessers that do not read the question score on the evaluation's cases
(devtools.chat_model.corpus.eval_cases), so that a model's figure is read against them: a model
beats these only by using the prompt. Each function returns the share of ``cases`` each guesser
gets right (an expected share for the uniform one); ``best`` is the highest."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import jsonschema

from devtools.chat_model.corpus import EvalCase


def tool_baselines(cases: Sequence[EvalCase]) -> dict[str, float]:
    """Of tool cases, those whose needed tool a guesser names: always the first tool listed,
    always the last, always the tool the cases need most often (the first listed where it is not
    offered), or one drawn uniformly. None of them writes the question's arguments: with the
    arguments checked, each scores 0."""
    listed = [([t["function"]["name"] for t in case.tools], case.tool) for case in cases]
    majority = Counter(needed for _, needed in listed).most_common(1)[0][0]
    return {
        "first": _share(offered[0] == needed for offered, needed in listed),
        "last": _share(offered[-1] == needed for offered, needed in listed),
        "majority": _share(
            (majority if majority in offered else offered[0]) == needed
            for offered, needed in listed
        ),
        "uniform": sum(1 / len(offered) for offered, _ in listed) / len(listed),
    }


def recall_baselines(cases: Sequence[EvalCase]) -> dict[str, float]:
    """Of recall cases, those a guesser answers with the told value: always the value the cases
    tell most often, or one of the told values drawn uniformly."""
    told = Counter(case.recall for case in cases)
    return {
        "majority": told.most_common(1)[0][1] / len(cases),
        "uniform": 1 / len(told),
    }


def json_baselines(cases: Sequence[EvalCase]) -> dict[str, float]:
    """Of JSON cases, those a guesser that reads only the schema answers validly: each required
    key with its type's empty value ("", 0, false). It writes none of the question's values."""
    empty = {"string": "", "integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}
    fits = []
    for case in cases:
        schema = case.schema or {}
        properties = schema.get("properties", {})
        filled = {key: empty[properties[key]["type"]] for key in schema.get("required", [])}
        fits.append(jsonschema.Draft202012Validator(schema).is_valid(filled))
    return {"type filler": _share(fits)}


def best(baselines: dict[str, float]) -> tuple[str, float]:
    """The guesser that scores highest, and its score."""
    name = max(baselines, key=lambda guesser: baselines[guesser])
    return name, baselines[name]


def _share(hits: Iterable[bool]) -> float:
    counted = list(hits)
    return sum(counted) / len(counted)
