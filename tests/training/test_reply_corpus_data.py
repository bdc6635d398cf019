"""The reply corpus a draft ships: the target's training replies, none to a held-out prompt."""

from __future__ import annotations

import torch

from dlite_ray.engine.reply_corpus import PROMPT_TAIL_TOKENS, ReplyCorpus
from dlite_ray.training import pipeline
from dlite_ray.training.data import Record
from dlite_ray.training.prompts import agent_eval_turns, build_prompt_set


def _record(prompt: list[int], reply: list[int]) -> Record:
    tokens = torch.tensor(prompt + reply, dtype=torch.int32)
    n = len(reply)
    return Record(tokens, len(prompt) - 1, torch.zeros(n, 1, 4, dtype=torch.bfloat16),
                  torch.zeros(n, dtype=torch.int32), torch.zeros(n, 2, dtype=torch.int32),
                  torch.zeros(n, 2, dtype=torch.float16))


def test_the_corpus_holds_each_reply_once_after_its_prompt_tail(tmp_path):
    prompt = list(range(100, 120))
    records = [_record(prompt, [1, 2, 3]), _record(prompt, [1, 2, 3]), _record([7, 8], [4, 5])]
    assert pipeline.corpus_replies(records) == [prompt[-PROMPT_TAIL_TOKENS:] + [1, 2, 3], [7, 8, 4, 5]]
    (tmp_path / "config.json").write_text("{}")
    pipeline.write_reply_corpus([tmp_path], records)
    corpus = ReplyCorpus.load(tmp_path)
    assert corpus.num_tokens == PROMPT_TAIL_TOKENS + 3 + 4
    assert corpus.propose(prompt[-PROMPT_TAIL_TOKENS:], 3) == [1, 2, 3]  # a reply's start, from its prompt's tail


class _TextTokenizer:
    """Decodes a prompt to the text it was made from."""

    def __init__(self, texts: dict[tuple[int, ...], str]):
        self.texts = texts

    def decode(self, ids: list[int]) -> str:
        return self.texts[tuple(ids)]


def test_records_of_held_out_prompts_are_left_out():
    benchmark_turn = sorted(agent_eval_turns())[0]
    dev_turn = build_prompt_set().dev[0].messages[-1]["content"]
    prompts = {"bench": [1, 2], "dev": [3, 4], "train": [5, 6]}
    texts = {(1, 2): f"system\nuser\n{benchmark_turn}\nassistant", (3, 4): f"user\n{dev_turn}",
             (5, 6): "user\nWrite a function that adds two numbers."}
    records = [_record(p, [9, 9]) for p in prompts.values()]
    kept = list(pipeline.without_held_out_prompts(records, _TextTokenizer(texts)))
    assert [r.tokens[:2].tolist() for r in kept] == [prompts["train"]]
