"""How close chat checkpoints are to copying a value from the prompt, read under teacher forcing
(issue #46): a greedy reply that never holds a made-up name says nothing of whether the model is
learning to copy it, while the share of the name's tokens it ranks first, given the answer so
far, does.

    .venv/bin/python bench/chat_copying.py --model DIR [--model DIR ...] [--cases 60]

For each checkpoint (loaded in float32 into transformers' DeepseekV3ForCausalLM as the trainer
loads one, on one thread), held-out recall cases (devtools.chat_model.corpus.eval_cases) end on
the answer "Your name is NAME.", rendered by the served template as the trainer renders
dialogues. Prints, for names made up per case ("made_up_recall": in no corpus) and for held-out
pool names ("recall"), the share of the name's tokens the model ranks first (teacher-forced
accuracy), the share of names whose every token it ranks first, and the mean loss per name token;
beside them a guesser's: the most frequent name token of the same cases, ranked first everywhere.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from devtools.chat_model.corpus import Dialogue, eval_cases
from devtools.chat_model.train import load, render
from infermesh.text.tokenizer import Tokenizer

_SEED = 2026
_KINDS = ("made_up_recall", "recall")


def name_positions(tok: Tokenizer, ids: list[int], learn: list[bool], name: str) -> list[int]:
    """The positions of the learnt (answer) tokens that spell ``name``."""
    start = learn.index(True)
    begin = _text(tok, ids[start:]).rindex(name)
    end = begin + len(name)
    positions = []
    for k in range(start, len(ids)):
        before = len(_text(tok, ids[start:k]))
        after = len(_text(tok, ids[start : k + 1]))
        if after > begin and before < end:
            positions.append(k)
    return positions


def _text(tok: Tokenizer, ids: list[int]) -> str:
    text = tok.hf.decode(ids)
    assert isinstance(text, str)
    return text


def measure(model: DeepseekV3ForCausalLM, tok: Tokenizer, kind: str, count: int) -> str:
    hits = whole = 0
    tokens = 0
    loss = 0.0
    targets: list[int] = []
    examples = []
    for case in eval_cases(kind, count, _SEED):
        answer = {"role": "assistant", "content": f"Your name is {case.recall}."}
        ids, learn = render(tok, Dialogue(kind, [*case.messages, answer]))
        positions = name_positions(tok, ids, learn, case.recall)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        predicted = [int(logits[p - 1].argmax()) for p in positions]
        right = [pred == ids[p] for pred, p in zip(predicted, positions, strict=True)]
        hits += sum(right)
        whole += all(right)
        tokens += len(positions)
        logprobs = torch.log_softmax(logits, dim=-1)
        loss -= sum(float(logprobs[p - 1, ids[p]]) for p in positions)
        targets += [ids[p] for p in positions]
        examples.append((case.recall, _text(tok, predicted)))
    guess = Counter(targets).most_common(1)[0][1] / len(targets)
    return (
        f"{kind}: name tokens ranked first {hits}/{tokens} = {hits / tokens:.0%} (guesser "
        f"{guess:.0%}), whole names {whole}/{count} = {whole / count:.0%}, loss per name token "
        f"{loss / tokens:.2f} (perplexity {math.exp(loss / tokens):.0f}); e.g. "
        + ", ".join(f"{name} -> {guessed!r}" for name, guessed in examples[:3])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", required=True)
    parser.add_argument("--cases", type=int, default=60, help="of each kind")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    for directory in ns.model:
        config = json.loads((directory / "config.json").read_text())
        config.pop("quantization_config", None)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**config))
        load(model, directory)
        model.train(False)
        tok = Tokenizer(directory)
        print(directory)
        for kind in _KINDS:
            print("  " + measure(model, tok, kind, ns.cases), flush=True)


if __name__ == "__main__":
    main()
