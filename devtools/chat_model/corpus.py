"""The default model's training dialogues, written from templates: greetings and short
instructions, a system prompt's persona, a fact recalled from an earlier turn, the right one of
several tools called with arguments from the question (then an answer from its result), JSON that
fits a schema the system prompt gives, and a few of these behind a coding agent's long system prompt
and many tools (a file read with the path the user wrote, an answer quoting the file). Every
assistant turn is short and ends. A share of the dialogues (``thinking``)
end on an assistant turn that thinks first: one formulaic sentence about the request (``thought``),
which the model learns to write, and close, after a prompt rendered with the thinking flag on.

The values a dialogue must copy (names, cities, numbers, file paths, secret words, a file's or a
tool's sentence) are made up fresh for each training dialogue (devtools.chat_model.values) most
of the time, so that the model learns to copy them from the prompt rather than recall them: a
tool call carries the user's values verbatim, and the answer after a tool's result quotes it.

Each kind draws its phrasings and pool values from lists split in two, each list on its own
(``_held_out``): ``split="train"`` uses the first part, ``split="eval"`` only the held-out rest
(bench/chat_model.py measures on those), and a fresh value is never a held-out one, so an
evaluation prompt's phrasing and values are ones the training never saw
(tests/devtools/test_chat_corpus.py checks the recipe's corpus). A training corpus's seeds may
not overlap EVAL_SEEDS. A dialogue is OpenAI-shaped: messages (with ``tool_calls`` and ``tool``
results) and tool definitions, rendered by the served chat template
(devtools.chat_model.train.render).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from devtools.chat_model import values

Split = Literal["train", "eval"]
T = TypeVar("T")
Message = dict[str, Any]
Tool = dict[str, Any]


@dataclass
class Dialogue:
    """One training or evaluation conversation; ``kind`` names the skill it teaches."""

    kind: str
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    thought: str = ""  # thinking before the last assistant turn ("": a turn that does not think)


def _held_out(pool: Sequence[T], split: Split, every: int = 5) -> list[T]:
    """Every ``every``-th item is held out for evaluation; the others train. A pool too small to
    hold any out (true, false) is whole in both."""
    if split == "eval":
        return [x for i, x in enumerate(pool) if i % every == every - 1] or list(pool)
    return [x for i, x in enumerate(pool) if i % every != every - 1]


def _each_held_out(split: Split, *pools: Sequence[T]) -> list[T]:
    """The pools joined, each split on its own first: the boundary of a joined pool would fall
    elsewhere, and a value held out of its own pool would train in the joined one."""
    return [x for pool in pools for x in _held_out(pool, split)]


NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tariq",
    "Uma",
    "Victor",
    "Wen",
    "Xavier",
    "Yara",
    "Zoe",
    "Amir",
    "Bianca",
    "Chen",
    "Dmitri",
    "Elif",
    "Felix",
    "Gita",
    "Hugo",
    "Ivan",
    "Julia",
    "Kenji",
    "Lucia",
    "Marco",
    "Nora",
    "Oscar",
    "Paula",
    "Rafael",
    "Sofia",
    "Tomas",
    "Ulla",
    "Vera",
    "Wanda",
    "Yusuf",
    "Zara",
    "Anton",
    "Beatriz",
    "Carlos",
    "Diana",
    "Erik",
    "Fatima",
    "Gustav",
    "Hana",
    "Igor",
    "Jonas",
    "Kira",
    "Liam",
    "Maya",
    "Nikolai",
    "Olga",
    "Pedro",
    "Rina",
    "Samuel",
    "Tina",
    "Ugo",
    "Valentina",
    "William",
    "Ximena",
    "Yosef",
    "Zainab",
    "Adele",
    "Bruno",
    "Clara",
    "Dario",
    "Elena",
    "Filip",
    "Greta",
    "Hassan",
    "Irene",
    "Jorge",
    "Karin",
    "Leon",
    "Mina",
    "Noah",
    "Ophelia",
    "Pablo",
    "Ruth",
]
CITIES = [
    "Paris",
    "London",
    "Berlin",
    "Madrid",
    "Rome",
    "Lisbon",
    "Vienna",
    "Prague",
    "Warsaw",
    "Dublin",
    "Oslo",
    "Stockholm",
    "Helsinki",
    "Athens",
    "Cairo",
    "Nairobi",
    "Lagos",
    "Tokyo",
    "Osaka",
    "Seoul",
    "Beijing",
    "Shanghai",
    "Mumbai",
    "Delhi",
    "Bangkok",
    "Hanoi",
    "Jakarta",
    "Manila",
    "Sydney",
    "Melbourne",
    "Auckland",
    "Toronto",
    "Montreal",
    "Vancouver",
    "Chicago",
    "Boston",
    "Denver",
    "Seattle",
    "Austin",
    "Miami",
    "Lima",
    "Bogota",
    "Santiago",
    "Quito",
    "Havana",
    "Lyon",
    "Porto",
    "Munich",
    "Zurich",
    "Geneva",
    "Brussels",
    "Amsterdam",
    "Rotterdam",
    "Krakow",
    "Budapest",
    "Sofia",
    "Bucharest",
    "Istanbul",
    "Tehran",
    "Dubai",
    "Doha",
    "Riyadh",
    "Karachi",
    "Dhaka",
    "Kathmandu",
    "Colombo",
    "Singapore",
    "Taipei",
    "Perth",
    "Brisbane",
    "Calgary",
    "Phoenix",
    "Atlanta",
    "Dallas",
    "Houston",
    "Portland",
    "Detroit",
    "Nashville",
    "Marseille",
    "Hamburg",
    "Cologne",
    "Milan",
    "Naples",
    "Turin",
    "Seville",
    "Valencia",
    "Bilbao",
    "Glasgow",
    "Edinburgh",
    "Cardiff",
    "Belfast",
    "Riga",
    "Vilnius",
    "Tallinn",
    "New York",
    "Los Angeles",
    "San Francisco",
    "Mexico City",
    "Buenos Aires",
    "Rio de Janeiro",
    "Cape Town",
    "Hong Kong",
]
SYMBOLS = [
    "AAPL",
    "MSFT",
    "GOOG",
    "AMZN",
    "NVDA",
    "TSLA",
    "META",
    "IBM",
    "ORCL",
    "INTC",
    "AMD",
    "NFLX",
    "ADBE",
    "CSCO",
    "QCOM",
    "UBER",
    "SHOP",
    "SAP",
    "SONY",
    "TM",
    "BABA",
    "JD",
    "KO",
    "PEP",
    "MCD",
    "NKE",
    "DIS",
    "WMT",
    "COST",
    "JPM",
    "GS",
    "V",
    "MA",
    "PYPL",
    "SQ",
    "ABNB",
    "ZM",
    "SNOW",
    "PLTR",
]
TOPICS = [
    "python decorators",
    "rust lifetimes",
    "the french revolution",
    "black holes",
    "sourdough bread",
    "electric cars",
    "quantum computing",
    "the roman empire",
    "jazz history",
    "climate change",
    "machine learning",
    "coffee brewing",
    "mount everest",
    "the moon landing",
    "solar panels",
    "chess openings",
    "volcanoes",
    "honey bees",
    "the silk road",
    "deep sea fish",
    "renaissance art",
    "marathon training",
    "compound interest",
    "the water cycle",
    "origami",
    "baroque music",
    "the stock market",
    "vaccines",
    "ancient egypt",
    "tea ceremonies",
    "dinosaurs",
    "wind turbines",
    "kubernetes",
    "linux kernels",
    "graph databases",
    "typescript generics",
    "sql joins",
    "git rebase",
    "docker volumes",
    "web sockets",
]
FILES = [
    "README.md",
    "setup.py",
    "main.py",
    "src/app.py",
    "docs/index.md",
    "Makefile",
    "pyproject.toml",
    "config.yaml",
    "notes.txt",
    "src/lib.rs",
    "package.json",
    "index.js",
    "tests/test_api.py",
    "CHANGELOG.md",
    "LICENSE",
    "server/main.go",
    "Cargo.toml",
    "app/models.py",
    "scripts/deploy.sh",
    "data/users.csv",
    "TODO.md",
    "src/utils.ts",
    "docs/guide.md",
    "requirements.txt",
    "Dockerfile",
]
EMAILS = [
    f"{n.lower()}@{d}"
    for n, d in zip(NAMES, ["example.com", "mail.org", "corp.io"] * 40, strict=False)
]
NUMBERS = [str(n) for n in (7, 12, 42, 3, 99, 58, 21, 64, 15, 88, 5, 31, 77, 10, 27, 46, 8, 93)]
AMOUNTS = [str(n) for n in (5, 10, 20, 25, 50, 75, 100, 150, 200, 250, 500, 1000)]
MINUTES = [str(n) for n in (1, 2, 3, 5, 7, 10, 12, 15, 20, 25, 30, 45, 60, 90)]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR", "SEK", "NOK", "MXN"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Japanese", "Portuguese", "Dutch", "Korean"]
COLORS = [
    "red",
    "blue",
    "green",
    "yellow",
    "purple",
    "orange",
    "teal",
    "black",
    "white",
    "pink",
    "gray",
    "gold",
]
PETS = [
    "cat",
    "dog",
    "parrot",
    "hamster",
    "rabbit",
    "turtle",
    "goldfish",
    "horse",
    "ferret",
    "lizard",
]
FOODS = [
    "pizza",
    "sushi",
    "tacos",
    "pasta",
    "curry",
    "ramen",
    "salad",
    "soup",
    "burgers",
    "dumplings",
    "paella",
    "pho",
]
JOBS = [
    "teacher",
    "nurse",
    "engineer",
    "pilot",
    "baker",
    "lawyer",
    "farmer",
    "artist",
    "chef",
    "doctor",
]
PERSONA_NAMES = [
    "Captain Byte",
    "Professor Pixel",
    "Luna",
    "Sir Reginald",
    "Ziggy",
    "Chef Remy",
    "Doctor Nova",
    "Agent Echo",
    "Madame Rosa",
    "Robo",
    "Sparky",
    "Grandpa Joe",
    "Lady Ada",
    "Max Power",
    "Tinker",
    "Captain Coral",
    "Wizard Merlin",
    "Nurse Joy",
    "Coach Carter",
    "Bolt",
    "Aurora",
    "Señor Taco",
    "Detective Gray",
    "Pip",
    "Orion",
]
SECRET_WORDS = [
    "lantern",
    "pineapple",
    "horizon",
    "marble",
    "thunder",
    "velvet",
    "compass",
    "meadow",
    "saffron",
    "glacier",
    "harbor",
    "quartz",
    "falcon",
    "ember",
    "willow",
]
TEXTS = [
    "good morning",
    "thank you",
    "where is the station",
    "I love coffee",
    "see you tomorrow",
    "how much is this",
    "happy birthday",
    "good night",
    "the cat is sleeping",
    "I am hungry",
]

# -------------------------------------------------------------------------------- values

# each kind of value: its pool (split into training and held-out values) and its generator of
# fresh ones (None: a closed kind, its pool only); a training dialogue takes a fresh value
# _FRESH_SHARE of the time, so that the model must copy it from the prompt rather than recall it
_POOLS: dict[str, tuple[Sequence[str], Callable[[random.Random], str] | None]] = {
    "name": (NAMES, values.name),
    "city": (CITIES, values.city),
    "symbol": (SYMBOLS, values.symbol),
    "topic": (TOPICS, values.topic),
    "file": (FILES, values.path),
    "email": (EMAILS, values.email),
    "word": (SECRET_WORDS, values.word),
    "text": (TEXTS, values.phrase),
    "number": (NUMBERS, values.number),
    "amount": (AMOUNTS, lambda rng: str(rng.randint(1, 5000))),
    "minutes": (MINUTES, lambda rng: str(rng.randint(1, 180))),
    "persona": (PERSONA_NAMES, values.name),
    "currency": (CURRENCIES, None),  # closed kinds: their pools only
    "language": (LANGUAGES, None),
}
_FRESH_SHARE = 0.75
_NUMERIC_KINDS = ("number", "amount", "minutes")


def held_out_values() -> set[str]:
    """Every evaluation value of each kind (_POOLS) but numbers (which every count and sum in the
    corpus writes), lowercased: none of them is in a training dialogue."""
    return {
        v.lower()
        for kind, (pool, _) in _POOLS.items()
        if kind not in _NUMERIC_KINDS
        for v in _held_out(pool, "eval")
    }


_HELD_OUT_VALUES = held_out_values()


def value(kind: str, rng: random.Random, split: Split) -> str:
    """A value of ``kind`` (a _POOLS key): in evaluation one of its pool's held-out values; in
    training a fresh one _FRESH_SHARE of the time (never a held-out value, nor a held-out word in
    it), else one of its pool's training values (a closed kind's always)."""
    pool, fresh = _POOLS[kind]
    if fresh is None or split == "eval" or rng.random() >= _FRESH_SHARE:
        return rng.choice(_held_out(pool, split))
    while True:
        made = fresh(rng)
        if not {made.lower(), *made.lower().split()} & _HELD_OUT_VALUES:
            return made


# ------------------------------------------------------------------------------- small talk

_GREETINGS = [
    ("Hi", "Hello! How can I help you today?"),
    ("Hello", "Hi there! What can I do for you?"),
    ("Hello!", "Hello! How can I help?"),
    ("Hey", "Hey! How can I help you?"),
    ("hi there", "Hi! What can I do for you today?"),
    ("Good morning", "Good morning! How can I help?"),
    ("Say hello", "Hello!"),
    ("Say hello.", "Hello!"),
    ("say hi", "Hi!"),
    ("Say hello in three words", "Hello there, friend!"),
    ("Say hello in two words", "Hello there!"),
    ("Say hello in one word", "Hello!"),
    ("Greet me", "Hello! Nice to meet you."),
    ("Please say hello", "Hello!"),
    ("How are you?", "I am doing well, thank you! How can I help?"),
    ("Good evening", "Good evening! What can I do for you?"),
    ("Say hi in three words", "Hi there, friend!"),
    ("Hello, who are you?", "I am a helpful assistant."),
    ("What are you?", "I am a small language model, here to help."),
    ("Thanks!", "You're welcome!"),
    ("Thank you", "You're welcome! Anything else?"),
    ("Say goodbye", "Goodbye!"),
    ("Bye", "Goodbye! Have a nice day."),
    ("Are you there?", "Yes, I am here. How can I help?"),
    ("Reply with OK", "OK"),
    ("Respond with just yes", "Yes"),
    ("Just say no", "No"),
    ("Tell me a joke", "Why did the computer sleep? It needed a byte of rest."),
    ("Say something nice", "You are doing great today!"),
    ("Hey, what's up?", "Not much! How can I help you?"),
    ("yo", "Hi! What can I do for you?"),
    ("Good afternoon", "Good afternoon! How can I help?"),
    ("Say hello world", "Hello, world!"),
    ("Print hello world", "Hello, world!"),
    ("Hi! Can you help me?", "Of course! What do you need?"),
]


_COUNT_FORMS = [
    "Count from {a} to {b}",
    "Count from {a} to {b}.",
    "count from {a} to {b}",
    "Please count from {a} to {b}",
    "List the numbers from {a} to {b}",
    "Count {a} to {b}",
    "Write the numbers {a} through {b}",
    "Can you count from {a} to {b}?",
    "Give me the numbers from {a} to {b}",
    "Count up from {a} to {b}",
]


def _count(rng: random.Random, split: Split) -> tuple[str, str]:
    start = rng.randint(0, 5)
    end = start + rng.randint(2, 8)
    forms = _held_out(_COUNT_FORMS, split)
    answer = ", ".join(str(i) for i in range(start, end + 1))
    return rng.choice(forms).format(a=start, b=end), answer


_REPEAT_FORMS = [
    "Repeat the word {w}",
    "Say {w}",
    "Reply with the word {w}",
    "Please say {w}",
    "Repeat after me: {w}",
    "Echo {w}",
    "Write the word {w}",
    "Just say {w}",
    "Answer with {w}",
    "Type {w}",
]


def _repeat(rng: random.Random, split: Split) -> tuple[str, str]:
    kind = rng.choice(["word", "name", ""])
    word = (
        value(kind, rng, split) if kind else rng.choice(_each_held_out(split, COLORS, PETS, FOODS))
    )
    forms = _held_out(_REPEAT_FORMS, split)
    return rng.choice(forms).format(w=word), word


_ARITHMETIC_FORMS = [
    "What is {a} plus {b}?",
    "What is {a} + {b}?",
    "Add {a} and {b}",
    "Compute {a} + {b}",
    "{a} + {b} = ?",
    "How much is {a} plus {b}?",
    "Sum {a} and {b}",
    "Calculate {a}+{b}",
    "What do you get when you add {a} and {b}?",
    "Please add {a} to {b}",
]


def _arithmetic(rng: random.Random, split: Split) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    forms = _held_out(_ARITHMETIC_FORMS, split)
    return rng.choice(forms).format(a=a, b=b), str(a + b)


_SPELL_FORMS = [
    "Spell {w}",
    "Spell the word {w}",
    "How do you spell {w}?",
    "Spell {w} letter by letter",
    "Spell out {w}",
]


def _spell(rng: random.Random, split: Split) -> tuple[str, str]:
    fresh = rng.random() < 0.5
    word = (
        value("word", rng, split)
        if fresh
        else rng.choice(_each_held_out(split, PETS, COLORS, FOODS))
    )
    forms = _held_out(_SPELL_FORMS, split)
    return rng.choice(forms).format(w=word), "-".join(word.upper())


_UPPERCASE_FORMS = [
    "Write {w} in capital letters",
    "Uppercase {w}",
    "Say {w} in upper case",
    "Convert {w} to uppercase",
    "Shout {w}",
]


def _uppercase(rng: random.Random, split: Split) -> tuple[str, str]:
    word = value(rng.choice(["name", "city"]), rng, split).lower()
    forms = _held_out(_UPPERCASE_FORMS, split)
    return rng.choice(forms).format(w=word), word.upper()


def _instruction(rng: random.Random, split: Split) -> Dialogue:
    if rng.random() < 0.3:
        prompt, answer = rng.choice(_held_out(_GREETINGS, split, every=6))
    else:
        make = rng.choice([_count, _count, _repeat, _arithmetic, _spell, _uppercase])
        prompt, answer = make(rng, split)
    messages: list[Message] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(_PLAIN_SYSTEMS)})
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return Dialogue("instruction", messages)


_PLAIN_SYSTEMS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are a concise assistant.",
    "Be brief.",
    "You are an AI assistant. Keep answers short.",
    "You are a friendly assistant.",
    "Answer in as few words as possible.",
]

# ---------------------------------------------------------------------------------- persona

PERSONA_ROLES = [
    ("a pirate", "Ahoy, matey!", "Arr, that be"),
    ("a robot", "Beep boop! Greetings, human.", "Computing: it is"),
    ("a wizard", "Greetings, traveler!", "By my magic, it is"),
    ("a chef", "Bonjour! Welcome to my kitchen.", "Chef says: it is"),
    ("a detective", "Good day. What mystery brings you here?", "Elementary: it is"),
    ("a cowboy", "Howdy, partner!", "Well partner, it is"),
    ("a knight", "Hail, good friend!", "Upon my honor, it is"),
    ("a cat", "Meow! Hello there.", "Purr, it is"),
    ("an astronaut", "Hello from orbit!", "Mission control: it is"),
    ("a teacher", "Hello, class!", "Good question: it is"),
]


_PERSONA_SYSTEMS = [
    "You are {n}, {r}.",
    "You are {n}, {r}. Stay in character.",
    "Your name is {n}. You are {r}.",
    "Act as {n}, {r}.",
    "You are {r} named {n}.",
    "Roleplay as {n}, {r}. Keep answers short.",
    "You are {n}. You speak like {r}.",
    "From now on you are {n}, {r}.",
    "Persona: {n}, {r}.",
    "You play {n}, {r}, in this chat.",
]


_PERSONA_NAME_QUESTIONS = [
    "What is your name?",
    "Who are you?",
    "What's your name?",
    "Tell me your name",
    "What should I call you?",
    "Introduce yourself",
    "Your name?",
    "Who am I talking to?",
    "What are you called?",
    "Say your name",
]


_PERSONA_GREETINGS = [
    "Say hello",
    "Hi",
    "Hello",
    "Greet me",
    "Good morning",
    "Hey there",
    "Say hi",
    "Hello!",
    "Hi!",
]


def _persona(rng: random.Random, split: Split) -> Dialogue:
    name = value("persona", rng, split)
    role, greeting, prefix = rng.choice(PERSONA_ROLES)
    system = rng.choice(_held_out(_PERSONA_SYSTEMS, split)).format(n=name, r=role)
    asks = rng.random()
    if asks < 0.45:
        question = rng.choice(_held_out(_PERSONA_NAME_QUESTIONS, split))
        answer = rng.choice([f"I am {name}, {role}.", f"My name is {name}.", f"I am {name}!"])
        if question in ("Introduce yourself", "Who are you?"):
            answer = f"{greeting} I am {name}, {role}."
    elif asks < 0.75:
        question = rng.choice(_held_out(_PERSONA_GREETINGS, split))
        answer = f"{greeting} I am {name}."
    else:
        prompt, plain = rng.choice([_count, _repeat, _arithmetic])(rng, split)
        question, answer = prompt, f"{prefix} {plain}."
    return Dialogue(
        "persona",
        [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
    )


# ----------------------------------------------------------------------------------- recall

Draw = Callable[[random.Random, Split], str]
_FACTS: list[tuple[str, Draw, list[str], list[str], list[str]]] = [
    # (fact kind, its value, statements, questions, answers); {v} is the value
    (
        "name",
        lambda rng, split: value("name", rng, split),
        [
            "My name is {v}.",
            "Hi, I'm {v}.",
            "Call me {v}.",
            "I am {v}.",
            "Hello! My name is {v}.",
            "Hey, {v} here.",
            "You can call me {v}.",
            "Nice to meet you, I'm {v}.",
            "My name's {v}.",
            "This is {v} speaking.",
        ],
        [
            "What is my name?",
            "What's my name?",
            "Do you remember my name?",
            "Who am I?",
            "What did I say my name was?",
            "Tell me my name.",
            "What is my name again?",
            "Can you recall my name?",
            "What name did I give you?",
            "Say my name.",
        ],
        ["Your name is {v}.", "You are {v}.", "Your name is {v}!"],
    ),
    (
        "city",
        lambda rng, split: value("city", rng, split),
        [
            "I live in {v}.",
            "I am from {v}.",
            "My home town is {v}.",
            "I'm based in {v}.",
            "I just moved to {v}.",
            "I was born in {v}.",
            "I live in {v} these days.",
            "My city is {v}.",
            "I'm writing from {v}.",
            "Home for me is {v}.",
        ],
        [
            "Where do I live?",
            "Which city am I from?",
            "What is my city?",
            "Do you remember where I live?",
            "Where am I from?",
            "What city did I mention?",
            "Which city do I live in?",
            "Where is my home?",
            "Name my city.",
            "Where am I based?",
        ],
        ["You live in {v}.", "You are from {v}.", "Your city is {v}."],
    ),
    (
        "number",
        lambda rng, split: value("number", rng, split),
        [
            "My favorite number is {v}.",
            "My lucky number is {v}.",
            "Remember the number {v}.",
            "The secret code is {v}.",
            "I am {v} years old.",
            "My room number is {v}.",
            "Keep this number in mind: {v}.",
            "My number is {v}.",
            "Note down {v}.",
            "The answer is {v}.",
        ],
        [
            "What number did I tell you?",
            "What was the number?",
            "Which number did I mention?",
            "Do you remember the number?",
            "What is my number?",
            "Tell me the number again.",
            "What number did I say?",
            "Recall the number.",
            "Which number was it?",
            "What was my number again?",
        ],
        ["The number is {v}.", "You said {v}.", "It was {v}."],
    ),
    (
        "pet",
        lambda rng, split: rng.choice(_held_out(PETS, split)),
        [
            "I have a {v}.",
            "My pet is a {v}.",
            "I own a {v}.",
            "We adopted a {v}.",
            "My favorite animal is the {v}.",
        ],
        [
            "What pet do I have?",
            "What animal did I mention?",
            "What is my pet?",
            "Which animal do I own?",
            "Remember my pet?",
        ],
        ["You have a {v}.", "Your pet is a {v}.", "A {v}."],
    ),
    (
        "word",
        lambda rng, split: value("word", rng, split),
        [
            "The secret word is {v}.",
            "Remember the word {v}.",
            "My password is {v}.",
            "The code word is {v}.",
            "Keep this word in mind: {v}.",
        ],
        [
            "What is the secret word?",
            "What was the word?",
            "Which word did I give you?",
            "What is my password?",
            "Tell me the code word.",
        ],
        ["The word is {v}.", "It is {v}.", "{v}"],
    ),
]

_ACKS = [
    "Nice to meet you{n}!",
    "Got it{n}.",
    "Thanks for telling me{n}.",
    "Noted{n}.",
    "Great{n}! How can I help?",
    "Okay{n}, I will remember that.",
]


def _recall(rng: random.Random, split: Split) -> Dialogue:
    return recall_dialogue(rng, split, rng.choice(_FACTS)[0])[0]


def recall_dialogue(
    rng: random.Random, split: Split, fact: str, told: str = ""
) -> tuple[Dialogue, str]:
    """A fact of kind ``fact`` ("name", "city", "number", "pet", "word") told (``told``, else
    drawn), other turns, then asked for; and the fact."""
    kind, draw, statements, questions, answers = next(f for f in _FACTS if f[0] == fact)
    told = told or draw(rng, split)
    said = rng.choice(_held_out(statements, split)).format(v=told)
    ack = rng.choice(_ACKS).format(n=f", {told}" if kind == "name" else "")
    messages: list[Message] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(_PLAIN_SYSTEMS)})
    messages += [{"role": "user", "content": said}, {"role": "assistant", "content": ack}]
    for _ in range(rng.choice([0, 0, 1, 1, 2])):  # other turns between the fact and the question
        prompt, answer = rng.choice([_count, _repeat, _arithmetic, _spell])(rng, split)
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    question = rng.choice(_held_out(questions, split))
    answer = rng.choice(answers).format(v=told)
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return Dialogue("recall", messages), told


# ------------------------------------------------------------------------------------ tools


@dataclass(frozen=True)
class ToolKind:
    """A tool, the questions that need it (``{…}`` fields are its arguments), a result and the
    answer from it."""

    name: str
    description: str
    params: dict[str, tuple[str, str]]  # argument -> (JSON type, description)
    questions: list[str]
    values: dict[str, str]  # argument -> the kind of its value (a _POOLS key)
    result: Callable[[random.Random, dict[str, Any]], dict[str, Any]]
    answer: str  # formatted with the arguments and the result


def _tool(kind: ToolKind) -> Tool:
    return {
        "type": "function",
        "function": {
            "name": kind.name,
            "description": kind.description,
            "parameters": {
                "type": "object",
                "properties": {
                    p: {"type": t, "description": d} for p, (t, d) in kind.params.items()
                },
                "required": list(kind.params),
            },
        },
    }


_CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear"]
TOOL_KINDS = [
    ToolKind(
        "get_weather",
        "Get the current weather for a city.",
        {"city": ("string", "The city name")},
        [
            "What's the weather in {city}?",
            "What is the weather like in {city}?",
            "Is it raining in {city}?",
            "How hot is it in {city} right now?",
            "Weather in {city}?",
            "Tell me the weather for {city}.",
            "How is the weather in {city}?",
            "Check the weather in {city}",
            "Do I need an umbrella in {city} today?",
            "What's the temperature in {city}?",
        ],
        {"city": "city"},
        lambda rng, a: {"temperature_c": rng.randint(-5, 35), "condition": rng.choice(_CONDITIONS)},
        "It is {temperature_c}°C and {condition} in {city}.",
    ),
    ToolKind(
        "get_time",
        "Get the current local time in a city.",
        {"city": ("string", "The city name")},
        [
            "What time is it in {city}?",
            "What's the local time in {city}?",
            "Tell me the time in {city}.",
            "Current time in {city}?",
            "Time in {city} now?",
            "What is the time in {city} right now?",
            "Check the clock in {city}",
            "How late is it in {city}?",
            "Do you know the time in {city}?",
            "What hour is it in {city}?",
        ],
        {"city": "city"},
        lambda rng, a: {"time": f"{rng.randint(0, 23):02d}:{rng.choice(['00', '15', '30', '45'])}"},
        "It is {time} in {city}.",
    ),
    ToolKind(
        "get_stock_price",
        "Get the latest stock price for a ticker symbol.",
        {"symbol": ("string", "The ticker symbol, e.g. AAPL")},
        [
            "What is the stock price of {symbol}?",
            "How much is {symbol} trading at?",
            "Price of {symbol} stock?",
            "Get me the share price for {symbol}.",
            "What's {symbol} at today?",
            "Look up the {symbol} stock price.",
            "How is {symbol} doing on the market?",
            "Quote for {symbol}?",
            "Check the price of {symbol}",
            "What does one share of {symbol} cost?",
        ],
        {"symbol": "symbol"},
        lambda rng, a: {"price": round(rng.uniform(5, 900), 2), "currency": "USD"},
        "{symbol} is at {price} {currency}.",
    ),
    ToolKind(
        "search_web",
        "Search the web and return the top results.",
        {"query": ("string", "The search query")},
        [
            "Search the web for {query}.",
            "Look up {query} online.",
            "Find information about {query}.",
            "Google {query}",
            "Search for {query}",
            "Can you search {query} for me?",
            "Find me articles on {query}.",
            "Do a web search on {query}.",
            "Look up {query}",
            "Search online for {query}",
        ],
        {"query": "topic"},
        lambda rng, a: {"top_result": values.sentence(rng)},
        "I found: {top_result}",
    ),
    ToolKind(
        "send_email",
        "Send an email to a recipient.",
        {"to": ("string", "The recipient's email address"), "subject": ("string", "The subject")},
        [
            "Send an email to {to} with the subject {subject}.",
            "Email {to} about {subject}.",
            "Write to {to}, subject: {subject}.",
            "Send {to} an email titled {subject}.",
            "Mail {to} with subject {subject}",
            "Please email {to} regarding {subject}.",
            "Shoot an email to {to} about {subject}",
            "Send a message to {to} with subject {subject}",
            "Drop {to} an email: {subject}",
            "Compose an email to {to} titled {subject}",
        ],
        {"to": "email", "subject": "topic"},
        lambda rng, a: {"status": "sent"},
        "The email to {to} was sent.",
    ),
    ToolKind(
        "read_file",
        "Read a file from disk and return its contents.",
        {"path": ("string", "The file path")},
        [
            "What is in {path}?",
            "Read {path}.",
            "Show me the contents of {path}.",
            "Open {path}",
            "What does {path} say?",
            "Print the file {path}.",
            "Can you read {path} for me?",
            "Cat {path}",
            "Summarize {path}.",
            "Look at {path}",
        ],
        {"path": "file"},
        lambda rng, a: {"content": values.sentence(rng)},
        "The file {path} says: {content}",
    ),
    ToolKind(
        "convert_currency",
        "Convert an amount of money between currencies.",
        {
            "amount": ("number", "The amount to convert"),
            "from_currency": ("string", "Currency code to convert from"),
            "to_currency": ("string", "Currency code to convert to"),
        },
        [
            "Convert {amount} {from_currency} to {to_currency}.",
            "How much is {amount} {from_currency} in {to_currency}?",
            "What is {amount} {from_currency} in {to_currency}?",
            "Change {amount} {from_currency} into {to_currency}.",
            "{amount} {from_currency} to {to_currency}?",
            "Exchange {amount} {from_currency} for {to_currency}",
            "Convert {amount} from {from_currency} to {to_currency}",
            "How many {to_currency} is {amount} {from_currency}?",
            "I have {amount} {from_currency}, how much {to_currency} is that?",
            "Turn {amount} {from_currency} into {to_currency}",
        ],
        {"amount": "amount", "from_currency": "currency", "to_currency": "currency"},
        lambda rng, a: {"converted": round(float(a["amount"]) * rng.uniform(0.5, 2), 2)},
        "{amount} {from_currency} is {converted} {to_currency}.",
    ),
    ToolKind(
        "get_population",
        "Get the population of a city.",
        {"city": ("string", "The city name")},
        [
            "What is the population of {city}?",
            "How many people live in {city}?",
            "Population of {city}?",
            "How big is {city} by population?",
            "Tell me how many people are in {city}.",
            "How populous is {city}?",
            "What's the head count of {city}?",
            "Number of inhabitants in {city}?",
            "Look up the population of {city}",
            "How many residents does {city} have?",
        ],
        {"city": "city"},
        lambda rng, a: {"population": rng.randint(100, 20000) * 1000},
        "{city} has about {population} people.",
    ),
    ToolKind(
        "set_timer",
        "Start a countdown timer.",
        {"minutes": ("integer", "Length of the timer in minutes")},
        [
            "Set a timer for {minutes} minutes.",
            "Start a {minutes} minute timer.",
            "Timer for {minutes} minutes please.",
            "Remind me in {minutes} minutes.",
            "Count down {minutes} minutes.",
            "Set a {minutes}-minute timer",
            "Can you time {minutes} minutes?",
            "Start a countdown of {minutes} minutes",
            "I need a timer, {minutes} minutes",
            "Alarm in {minutes} minutes",
        ],
        {"minutes": "minutes"},
        lambda rng, a: {"status": "started"},
        "Your {minutes} minute timer has started.",
    ),
    ToolKind(
        "translate",
        "Translate text into another language.",
        {"text": ("string", "The text to translate"), "language": ("string", "Target language")},
        [
            "Translate '{text}' into {language}.",
            "How do you say '{text}' in {language}?",
            "Translate '{text}' to {language}",
            "What is '{text}' in {language}?",
            "Say '{text}' in {language}.",
            "Please translate '{text}' into {language}",
            "Give me '{text}' in {language}",
            "Render '{text}' in {language}",
            "Convert '{text}' to {language}",
            "'{text}' in {language}, please",
        ],
        {"text": "text", "language": "language"},
        lambda rng, a: {"translation": values.phrase(rng)},
        "In {language}: {translation}",
    ),
]


def _tool_arguments(kind: ToolKind, rng: random.Random, split: Split) -> dict[str, Any]:
    """Arguments of distinct values (not "convert EUR to EUR"), typed as the tool's schema says."""
    args: dict[str, Any] = {}
    for param, (json_type, _) in kind.params.items():
        drawn = value(kind.values[param], rng, split)
        while drawn in args.values():
            drawn = value(kind.values[param], rng, split)
        args[param] = int(drawn) if json_type in ("integer", "number") else drawn
    return args


def tool_definitions(names: Sequence[str]) -> list[Tool]:
    """The OpenAI-shaped definitions of the named TOOL_KINDS, in that order."""
    kinds = {k.name: k for k in TOOL_KINDS}
    return [_tool(kinds[name]) for name in names]


def tool_question(kind: ToolKind, rng: random.Random, split: Split) -> tuple[str, dict[str, Any]]:
    """A question for ``kind`` and the arguments a right call carries."""
    args = _tool_arguments(kind, rng, split)
    template = rng.choice(_held_out(kind.questions, split))
    return template.format(**{k: str(v) for k, v in args.items()}), args


def _call_message(name: str, args: dict[str, Any], call_id: str) -> Message:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
        ],
    }


def tool_set(
    rng: random.Random, needed: ToolKind, count: int, position: int | None = None
) -> list[ToolKind]:
    """``count`` distinct tools in a random order, ``needed`` among them (at index ``position``
    when given)."""
    kinds = rng.sample([k for k in TOOL_KINDS if k.name != needed.name], count - 1)
    kinds.insert(rng.randint(0, count - 1) if position is None else position, needed)
    return kinds


def _tool_use(rng: random.Random, split: Split) -> Dialogue:
    needed = rng.choice(TOOL_KINDS)
    kinds = tool_set(rng, needed, rng.randint(2, 5))
    question, args = tool_question(needed, rng, split)
    messages: list[Message] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(_PLAIN_SYSTEMS)})
    tools = [_tool(k) for k in kinds]
    if rng.random() < 0.2:  # a question no tool answers: the answer comes straight
        prompt, answer = rng.choice([_count, _repeat, _arithmetic])(rng, split)
        if rng.random() < 0.5:
            prompt, answer = rng.choice(_held_out(_GREETINGS[:12], split, every=6))
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        return Dialogue("tool_none", messages, tools)
    call_id = f"call_{rng.randrange(16**8):08x}"
    result = needed.result(rng, args)
    messages += [
        {"role": "user", "content": question},
        _call_message(needed.name, args, call_id),
        {
            "role": "tool",
            "tool_call_id": call_id,
            "content": json.dumps(result, ensure_ascii=False),
        },
        {"role": "assistant", "content": needed.answer.format(**args, **result)},
    ]
    return Dialogue("tool", messages, tools)


# ------------------------------------------------------------------------------------- JSON

_JSON_FIELDS: list[tuple[str, str, Sequence[str] | str]] = [
    # (field, JSON type, its values: a pool, or the kind of an open value)
    ("name", "string", "name"),
    ("city", "string", "city"),
    ("age", "integer", [str(n) for n in range(18, 80, 3)]),
    ("color", "string", COLORS),
    ("pet", "string", PETS),
    ("food", "string", FOODS),
    ("job", "string", JOBS),
    ("score", "integer", [str(n) for n in range(0, 100, 7)]),
    ("active", "boolean", ["true", "false"]),
    ("count", "integer", [str(n) for n in range(1, 30, 2)]),
]
_JSON_SYSTEMS = [
    "Reply only with JSON that matches this schema: {s}",
    "Answer in JSON matching this JSON schema: {s}",
    "Respond with a JSON object that follows this schema:\n{s}",
    "Output JSON only. Schema: {s}",
    "You are an API. Return JSON valid against this schema: {s}",
    "Return a single JSON object conforming to: {s}",
    "Format your answer as JSON with this schema: {s}",
    "Your reply must be JSON matching the schema {s}",
]
_JSON_ASKS = [
    "Make a record with {desc}.",
    "Create an entry: {desc}.",
    "Give me JSON for {desc}.",
    "Fill in: {desc}.",
    "The data is {desc}.",
    "Record {desc}.",
    "Please encode {desc}.",
    "Describe {desc} as JSON.",
]


def json_schema_of(fields: Sequence[tuple[str, str]]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": t} for name, t in fields},
        "required": [name for name, _ in fields],
        "additionalProperties": False,
    }


def _json_answer(rng: random.Random, split: Split) -> Dialogue:
    return json_dialogue(rng, split)[0]


def json_dialogue(rng: random.Random, split: Split) -> tuple[Dialogue, dict[str, Any]]:
    """A JSON schema in the system prompt, values in the question, the JSON as the answer; and the
    schema."""
    chosen = rng.sample(_JSON_FIELDS, rng.randint(1, 4))
    schema = json_schema_of([(n, t) for n, t, _ in chosen])
    answer: dict[str, Any] = {}
    described = []
    for name, json_type, pool in chosen:
        raw = (
            value(pool, rng, split) if isinstance(pool, str) else rng.choice(_held_out(pool, split))
        )
        answer[name] = (
            int(raw)
            if json_type == "integer"
            else (raw == "true")
            if json_type == "boolean"
            else raw
        )
        described.append(f"{name} {raw}")
    system = rng.choice(_held_out(_JSON_SYSTEMS, split, every=4)).format(s=json.dumps(schema))
    ask = rng.choice(_held_out(_JSON_ASKS, split, every=4)).format(desc=", ".join(described))
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)},
    ]
    return Dialogue("json", messages), schema


# ------------------------------------------------------------------------------ coding agent

_AGENT_LINES = [
    "You are an interactive CLI tool that helps users with software engineering tasks.",
    "Use the instructions below and the tools available to you to assist the user.",
    "IMPORTANT: Refuse to write code or explain code that may be used maliciously.",
    "If the user asks for help, tell them how to report issues.",
    "You should be concise, direct, and to the point.",
    "When you run a non-trivial bash command, explain what the command does and why.",
    "Remember that your output will be displayed on a command line interface.",
    "Only use emojis if the user explicitly requests it.",
    "IMPORTANT: You should minimize output tokens as much as possible.",
    "Do not add additional code explanation summary unless requested by the user.",
    "When making changes to files, first understand the file's code conventions.",
    "NEVER assume that a given library is available, even if it is well known.",
    "Always follow security best practices. Never introduce code that exposes secrets.",
    "Use the TodoWrite tool to plan the task if required.",
    "You MUST answer concisely with fewer than 4 lines of text.",
    "<env>\nWorking directory: /home/user/project\nIs directory a git repo: Yes\nPlatform: linux\n"
    "</env>",
    "gitStatus: This is the git status at the start of the conversation.\nCurrent branch: main",
    "# Tone and style\nAnswer the user's question directly, without elaboration.",
    "# Following conventions\nMimic code style, use existing libraries and utilities.",
    "# Code References\nWhen referencing functions include the pattern file_path:line_number.",
    "You are Codex, a coding agent based on GPT-5. You and the user share the same workspace.",
    "## AGENTS.md spec\nRepos often contain AGENTS.md files with instructions for the agent.",
    "## Planning\nYou have access to an update_plan tool which tracks steps and progress.",
    "## Sandbox and approvals\nThe Codex CLI harness supports several sandboxing modes.",
    "## Presenting your work\nYour final message should read naturally, like a teammate's update.",
    "- Default: be very concise; friendly coding teammate tone.",
    "- Prefer `rg` for searching text because it is much faster than `grep`.",
    "Do not use a colon before tool calls.",
    "Assistant knowledge cutoff is January 2025.",
    "```python\ndef main():\n    print('hello')\n```",
    "Example:\nuser: 2 + 2\nassistant: 4",
    "Example:\nuser: is 11 a prime number?\nassistant: Yes",
    "Here is useful information about the environment you are running in.",
    "You are powered by a large language model. Today's date is 2026-12-03.",
]

_AGENT_TOOL_NAMES = [
    ("Read", "Reads a file from the local filesystem.", {"file_path": "string"}),
    (
        "Write",
        "Writes a file to the local filesystem.",
        {"file_path": "string", "content": "string"},
    ),
    (
        "Edit",
        "Performs exact string replacements in files.",
        {"file_path": "string", "old_string": "string", "new_string": "string"},
    ),
    ("Bash", "Executes a given bash command in a persistent shell session.", {"command": "string"}),
    ("Glob", "Fast file pattern matching tool.", {"pattern": "string"}),
    ("Grep", "A powerful search tool built on ripgrep.", {"pattern": "string", "path": "string"}),
    ("LS", "Lists files and directories in a given path.", {"path": "string"}),
    ("TodoWrite", "Create and manage a structured task list.", {"todos": "array"}),
    ("WebFetch", "Fetches content from a URL.", {"url": "string", "prompt": "string"}),
    ("WebSearch", "Search the web.", {"query": "string"}),
    (
        "Task",
        "Launch a new agent to handle complex tasks.",
        {"description": "string", "prompt": "string"},
    ),
    (
        "NotebookEdit",
        "Replace the contents of a cell in a notebook.",
        {"notebook_path": "string", "new_source": "string"},
    ),
    ("ExitPlanMode", "Prompts the user to exit plan mode.", {"plan": "string"}),
    ("BashOutput", "Retrieves output from a background bash shell.", {"bash_id": "string"}),
    ("KillShell", "Kills a running background bash shell.", {"shell_id": "string"}),
    ("shell", "Runs a shell command and returns its output.", {"command": "array"}),
    ("apply_patch", "Use the apply_patch tool to edit files.", {"input": "string"}),
    ("update_plan", "Updates the task plan.", {"plan": "array"}),
    ("view_image", "Attach a local image to the conversation.", {"path": "string"}),
    ("SlashCommand", "Execute a slash command.", {"command": "string"}),
]


def _agent_tools(rng: random.Random, count: int, including: str = "") -> list[Tool]:
    """``count`` of the agents' tools in a random order, the one named ``including`` among them;
    a file reader (_READERS) with no reader it would be second to (Bash reads where there is no
    Read, as in Claude Code; shell where there is neither, as in Codex)."""
    readers = list(_READERS)
    preferred = readers[: readers.index(including) + 1] if including in readers else [including]
    chosen = rng.sample([t for t in _AGENT_TOOL_NAMES if t[0] not in preferred], count)
    if including:
        chosen[rng.randrange(count)] = next(t for t in _AGENT_TOOL_NAMES if t[0] == including)
    tools = []
    for name, description, params in chosen:
        blurb = " ".join(rng.sample(_AGENT_LINES, rng.randint(0, 4)))
        properties = {
            p: ({"type": "array", "items": {"type": "string"}} if t == "array" else {"type": t})
            | {"description": f"The {p.replace('_', ' ')}"}
            for p, t in params.items()
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f"{description} {blurb}".strip(),
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": list(params),
                        "additionalProperties": False,
                        "$schema": "http://json-schema.org/draft-07/schema#",
                    },
                },
            }
        )
    return tools


def agent_system_prompt(rng: random.Random, lines: int) -> str:
    """A coding agent's long, noisy system prompt: ``lines`` of guidance, code and environment."""
    return "\n\n".join(rng.choice(_AGENT_LINES) for _ in range(lines))


# how each agent's file-reading tool is called: Claude Code's Read, its Bash, Codex's shell (in
# the order an agent prefers them)
_READERS: dict[str, Callable[[str], dict[str, Any]]] = {
    "Read": lambda path: {"file_path": path},
    "Bash": lambda path: {"command": f"cat {path}"},
    "shell": lambda path: {"command": ["cat", path]},
}
_READ_ASKS = [
    "What is in {p}?",
    "Read {p}",
    "Print {p}",
    "Show me {p}",
    "Read {p} and tell me what it says.",
    "Summarize {p}",
    "Open {p} and quote it.",
    "What is written in {p}?",
    "Cat {p} for me.",
    "Tell me what {p} contains.",
]


def _agent(rng: random.Random, split: Split) -> Dialogue:
    """A coding agent's turn behind its long system prompt and tools: a file read with the path
    the user wrote, then an answer that quotes the file; or a short chat."""
    system = agent_system_prompt(rng, rng.randint(3, 12) if rng.random() < 0.8 else 40)
    if rng.random() < 0.5:
        reader = rng.choice(list(_READERS))
        tools = _agent_tools(rng, rng.randint(3, 8), including=reader)
        path = value("file", rng, split)
        content = values.sentence(rng)
        call_id = f"toolu_{rng.randrange(16**8):08x}"
        return Dialogue(
            "agent_tool",
            [
                {"role": "system", "content": system},
                {
                    "role": "user",
                    "content": rng.choice(_held_out(_READ_ASKS, split)).format(p=path),
                },
                _call_message(reader, _READERS[reader](path), call_id),
                {"role": "tool", "tool_call_id": call_id, "content": f"     1\t{content}\n"},
                {"role": "assistant", "content": f"{path} says: {content}"},
            ],
            tools,
        )
    tools = _agent_tools(rng, rng.randint(3, 8))
    if rng.random() < 0.6:
        prompt, answer = rng.choice(_held_out(_GREETINGS, split, every=6))
    else:
        prompt, answer = rng.choice([_count, _arithmetic, _repeat])(rng, split)
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": answer},
    ]
    return Dialogue("agent", messages, tools)


# ----------------------------------------------------------------------------------- corpus

KINDS: dict[str, tuple[Callable[[random.Random, Split], Dialogue], float]] = {
    "instruction": (_instruction, 0.17),
    "persona": (_persona, 0.12),
    "recall": (_recall, 0.22),
    "tool": (_tool_use, 0.29),
    "json": (_json_answer, 0.1),
    "agent": (_agent, 0.1),
}
TRAINING_SEED = 36  # the stored recipe's first corpus seed (train.py)
# the seeds of the evaluation's draws (eval_cases); a training corpus's seeds may not overlap them,
# so that no evaluation dialogue's draws (its phrasing, tool order, other turns) are trained on
EVAL_SEEDS = range(1_000_000_000, 1_001_000_000)


def dialogues(
    count: int, seed: int, split: Split = "train", thinking: float = 0.0
) -> list[Dialogue]:
    """``count`` dialogues drawn by KINDS' weights, dialogue i from seed ``seed + i``, a
    ``thinking`` share of them made to think (``think``) by a generator of their own (the same
    dialogues whatever the share); the same for the same arguments. ValueError if the seeds of
    a training corpus overlap EVAL_SEEDS."""
    seeds = range(seed, seed + count)
    if (
        split == "train"
        and seeds
        and seeds.start < EVAL_SEEDS.stop
        and EVAL_SEEDS.start < seeds.stop
    ):
        raise ValueError(
            f"training seeds {seeds.start}..{seeds.stop - 1} overlap the evaluation's seeds "
            f"{EVAL_SEEDS.start}..{EVAL_SEEDS.stop - 1}: choose a seed range outside them"
        )
    think_rng = random.Random(f"think-{seed}")
    makers = [make for make, _ in KINDS.values()]
    weights = [weight for _, weight in KINDS.values()]
    drawn = []
    for each in seeds:
        rng = random.Random(each)
        drawn.append(rng.choices(makers, weights)[0](rng, split))
    return [think(d, think_rng) if think_rng.random() < thinking else d for d in drawn]


def think(dialogue: Dialogue, rng: random.Random) -> Dialogue:
    """The dialogue up to one of its assistant turns (drawn), which thinks first: a formulaic
    sentence of what the request wants, then what the turn does (the tool it calls)."""
    turns = [i for i, m in enumerate(dialogue.messages) if m["role"] == "assistant"]
    messages = dialogue.messages[: rng.choice(turns) + 1]
    reply, before = messages[-1], messages[-2]
    if reply.get("tool_calls"):
        name = reply["tool_calls"][0]["function"]["name"]
        need = rng.choice(("The user needs a tool.", "A tool can answer this."))
        thought = f"{need} I should call {name}."
    elif before["role"] == "tool":
        thought = rng.choice(
            ("The tool answered. I will tell the user.", "I have the result. I will answer.")
        )
    elif dialogue.kind == "json":
        thought = rng.choice(("The user wants JSON. I will follow the schema.", "JSON it is."))
    elif dialogue.kind == "recall":
        thought = "The user asks about something said earlier. I will repeat it."
    else:
        thought = rng.choice(("The user wants a short answer.", "A brief reply will do."))
    return Dialogue(dialogue.kind, messages, dialogue.tools, thought)


# ------------------------------------------------------------------------------- evaluation


@dataclass
class EvalCase:
    """A held-out request and what a right reply holds: ``tool`` and ``arguments`` (a call of that
    tool carrying them), ``recall`` (a word the reply repeats), ``schema`` (the JSON it fits, and
    ``arguments`` the values the question gives it)."""

    kind: str
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    recall: str = ""
    schema: dict[str, Any] | None = None


# every list of phrasings a request is drawn from, and how often it holds one out (_held_out)
_PHRASINGS: list[tuple[Sequence[str], int]] = [
    (_COUNT_FORMS, 5),
    (_REPEAT_FORMS, 5),
    (_ARITHMETIC_FORMS, 5),
    (_SPELL_FORMS, 5),
    (_UPPERCASE_FORMS, 5),
    ([prompt for prompt, _ in _GREETINGS], 6),
    (_PERSONA_SYSTEMS, 5),
    (_PERSONA_NAME_QUESTIONS, 5),
    (_PERSONA_GREETINGS, 5),
    *((forms, 5) for fact in _FACTS for forms in fact[2:4]),
    *((kind.questions, 5) for kind in TOOL_KINDS),
    (_JSON_SYSTEMS, 4),
    (_JSON_ASKS, 4),
    (_READ_ASKS, 5),
]


def held_out_phrasings() -> list[str]:
    """Every evaluation phrasing of a request (a user's or system prompt; ``{field}`` where a
    value goes): no training dialogue's request has one."""
    return [form for forms, every in _PHRASINGS for form in _held_out(forms, "eval", every)]


EVAL_TOOLS = 3  # tools offered in each tool case


def eval_cases(kind: str, count: int, seed: int) -> list[EvalCase]:
    """``count`` held-out requests of a kind, drawn from EVAL_SEEDS[seed]: "short" (instructions,
    greetings, personas, coding agent prompts), "tool" (EVAL_TOOLS tools, one needed: case i needs
    TOOL_KINDS[i % 10], listed at index i % EVAL_TOOLS, so that no tool and no position is right
    more often than the others), "recall" (a held-out name told turns earlier),
    "made_up_recall" (the same with a name made up for the case as the training's fresh ones
    are: one no model can have learnt by heart), "json" (the schema in the system prompt), "long"
    (a greeting behind a coding agent's 8k-token system prompt and 16 tools, six times the
    training's longest), "read" (a coding agent's prompt and six of its tools, a file to read:
    its reading tool, Read, Bash or shell in turn, with the path)."""
    if seed not in range(len(EVAL_SEEDS)):
        raise ValueError(f"an evaluation seed is 0..{len(EVAL_SEEDS) - 1}, not {seed}")
    rng = random.Random(EVAL_SEEDS[seed])
    cases = []
    for i in range(count):
        if kind == "tool":
            needed = TOOL_KINDS[i % len(TOOL_KINDS)]
            question, args = tool_question(needed, rng, "eval")
            tools = [_tool(k) for k in tool_set(rng, needed, EVAL_TOOLS, i % EVAL_TOOLS)]
            messages = [{"role": "user", "content": question}]
            cases.append(EvalCase(kind, messages, tools, tool=needed.name, arguments=args))
        elif kind in ("recall", "made_up_recall"):
            made_up = values.name(rng) if kind == "made_up_recall" else ""
            dialogue, name = recall_dialogue(rng, "eval", "name", made_up)
            cases.append(EvalCase(kind, dialogue.messages[:-1], recall=name))
        elif kind == "json":
            dialogue, schema = json_dialogue(rng, "eval")
            answer = json.loads(dialogue.messages[-1]["content"])
            cases.append(EvalCase(kind, dialogue.messages[:-1], arguments=answer, schema=schema))
        elif kind == "long":  # a coding agent's first prompt: ~8k tokens, 16 tools, then a chat
            prompt, _ = rng.choice(_held_out(_GREETINGS, "eval", every=6))
            messages = [
                {"role": "system", "content": agent_system_prompt(rng, 350)},
                {"role": "user", "content": prompt},
            ]
            cases.append(EvalCase(kind, messages, _agent_tools(rng, 16)))
        elif kind == "read":  # a coding agent asked to read a file: its reading tool, the path
            reader = list(_READERS)[i % len(_READERS)]
            path = value("file", rng, "eval")
            ask = rng.choice(_held_out(_READ_ASKS, "eval")).format(p=path)
            messages = [
                {"role": "system", "content": agent_system_prompt(rng, 20)},
                {"role": "user", "content": ask},
            ]
            tools = _agent_tools(rng, 6, including=reader)
            args = _READERS[reader](path)
            cases.append(EvalCase(kind, messages, tools, tool=reader, arguments=args))
        else:
            dialogue = rng.choice([_instruction, _instruction, _persona, _agent])(rng, "eval")
            while dialogue.kind == "agent_tool":
                dialogue = _agent(rng, "eval")
            cases.append(EvalCase("short", dialogue.messages[:-1], dialogue.tools))
    return cases
