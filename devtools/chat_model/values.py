"""Values made up fresh for each training dialogue: names, cities, ticker symbols, words, file
paths, e-mail addresses and sentences spelt from random syllables, so that a model trained on them
cannot learn the values by heart and must copy them from the prompt (Olsson et al., 2022: a
corpus of repeated, unmemorisable spans is what forms the induction heads that copy).

Each generator takes the dialogue's random generator and returns one value; none of them knows
the evaluation's values, which devtools.chat_model.corpus keeps out (``fresh``)."""

from __future__ import annotations

import random

_ONSETS = [*"bcdfghjklmnprstvwz", "br", "dr", "fr", "gr", "kr", "pr", "tr", "st", "sk", "sl"]
_ONSETS += ["sh", "ch", "th", "bl", "fl", "gl", "pl", "cl"]
_VOWELS = [*"aeiouaeio", "ai", "ou", "ei", "ia"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "k", "t"]
_CITY_SUFFIXES = ["burg", "ville", "port", "holm", "stad", "ford", "mouth", "haven", "dale", "wick"]
_CITY_PREFIXES = ["Port", "San", "New", "Lake", "Fort", "Saint", "North", "East"]
_DIRECTORIES = ["src", "docs", "lib", "app", "tests", "scripts", "config", "pkg", "notes", "data"]
_EXTENSIONS = ["py", "md", "txt", "rs", "go", "ts", "js", "toml", "yaml", "json", "sh", "csv"]
_DOMAINS = ["com", "org", "io", "net", "dev"]
_SENTENCE_FORMS = [
    "The {w1} is {w2}.",
    "{N} keeps the {w1} in {C}.",
    "Deploy the {w1} before {w2}.",
    "The {w1} {w2} runs every {n} minutes.",
    "{N} wrote this {w1} in {C}.",
    "Remember: {w1} {w2} {w3}.",
    "Version {n} adds the {w1} flag.",
    "This project builds {w1} for {N}.",
]


def word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    """A made-up lowercase word of ``syllables`` (least, most) syllables."""
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.randint(*syllables))
    )


def name(rng: random.Random) -> str:
    """A made-up given name, capitalized (``Zoltan``'s shape)."""
    return word(rng).capitalize()


def city(rng: random.Random) -> str:
    """A made-up city: one word, one with a suffix, or two words."""
    shape = rng.random()
    if shape < 0.4:
        return word(rng).capitalize()
    if shape < 0.8:
        return (word(rng, (1, 2)) + rng.choice(_CITY_SUFFIXES)).capitalize()
    return f"{rng.choice(_CITY_PREFIXES)} {word(rng).capitalize()}"


def symbol(rng: random.Random) -> str:
    """A made-up ticker symbol: two to five capital letters."""
    return "".join(chr(rng.randint(65, 90)) for _ in range(rng.randint(2, 5)))


def path(rng: random.Random) -> str:
    """A made-up relative file path, in a directory or not."""
    stem = rng.choice([word(rng), f"{word(rng, (1, 2))}_{word(rng, (1, 2))}"])
    file = f"{stem}.{rng.choice(_EXTENSIONS)}"
    depth = rng.choice([0, 1, 1, 2])
    return "/".join([*rng.sample(_DIRECTORIES, depth), file])


def email(rng: random.Random) -> str:
    """A made-up e-mail address."""
    return f"{word(rng).lower()}@{word(rng, (1, 2))}.{rng.choice(_DOMAINS)}"


def topic(rng: random.Random) -> str:
    """A made-up topic of one or two words."""
    return " ".join(word(rng) for _ in range(rng.randint(1, 2)))


def phrase(rng: random.Random) -> str:
    """A made-up lowercase phrase of two to four words."""
    return " ".join(word(rng, (1, 2)) for _ in range(rng.randint(2, 4)))


def sentence(rng: random.Random) -> str:
    """A made-up sentence, as a file or a tool's result holds one, for an answer to quote."""
    return rng.choice(_SENTENCE_FORMS).format(
        w1=word(rng),
        w2=word(rng),
        w3=word(rng),
        N=name(rng),
        C=city(rng),
        n=rng.randint(2, 99),
    )


def number(rng: random.Random) -> str:
    """A made-up whole number of one to four digits."""
    return str(rng.randint(0, 10 ** rng.randint(1, 4) - 1))
