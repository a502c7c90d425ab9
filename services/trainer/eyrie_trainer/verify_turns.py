"""MT-Bench's second turn, asked as FastChat asks it: after the model's OWN first answer.

Each server verify starts (the target alone, the target with the drafter at each K) answers a set's first turns,
then is asked each question's second user turn in the conversation [user 1, assistant: its own first answer,
user 2], rendered by the target's chat template with the generation prompt added. Its answer is decoded from
the token ids vLLM returned with the target's tokenizer (special tokens skipped) and stripped, as FastChat's
gen_model_answer does. Two servers whose first answers differ are asked different second prompts: their second
answers are compared only where the first were equal (eyrie_trainer.verify_figures.second_turn_result).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyrie_trainer.benchmarks import Benchmark


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The messages as the target's chat template renders them, generation prompt added, as token ids."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class SecondTurns:
    """A set's second user turns (None: a question without one) and how to ask them: the target's tokenizer, the
    answer length and the served context (None: unbounded)."""

    first: list[list[dict]]
    second: list[str | None]
    tokenizer: Any
    max_tokens: int
    context: int | None = None

    @classmethod
    def of(cls, bench: Benchmark, tokenizer, max_tokens: int, context: int | None) -> "SecondTurns | None":
        return cls(bench.prompts, bench.second_turns, tokenizer, max_tokens, context) if bench.second_turns else None

    def conversation(self, question: int, answer: list[int]) -> list[dict]:
        """The question's second turn after `answer` (the server's own first answer, as token ids)."""
        said = self.tokenizer.decode(answer, skip_special_tokens=True).strip()
        return [*self.first[question], {"role": "assistant", "content": said},
                {"role": "user", "content": self.second[question]}]

    def prompts(self, answers: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        """The questions asked their second turn after these first answers, and their prompts as token ids: every
        question that has one, but for a prompt leaving no room for an answer within the served context."""
        asked, prompts = [], []
        for question, answer in enumerate(answers):
            if self.second[question] is None:
                continue
            prompt = chat_prompt_ids(self.tokenizer, self.conversation(question, answer))
            if self.context is None or len(prompt) < self.context:
                asked.append(question)
                prompts.append(prompt)
        return asked, prompts

    def limits(self, prompts: list[list[int]]) -> list[int]:
        """max_tokens per prompt, within the served context."""
        return [min(self.max_tokens, self.context - len(p)) if self.context else self.max_tokens for p in prompts]

    def questions(self) -> int:
        return sum(s is not None for s in self.second)


def second_turn_pass(client, turns: SecondTurns, first_answers: list[list[int]], serial: int) -> dict:
    """The server behind `client` asked the second turns after its own first answers (8 in flight, then the first
    `serial` one at a time, its counters read around the 8-in-flight pass): Client.one_pass's figures, with the
    questions asked."""
    asked, prompts = turns.prompts(first_answers)
    return {**client.one_pass(prompts, turns.limits(prompts), serial), "asked": asked, "questions": turns.questions()}
