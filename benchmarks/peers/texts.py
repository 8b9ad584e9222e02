"""The fixed texts of the llama.cpp comparison, as token ids (workloads.Texts), tokenized once by the engine.

The document is real prose (dendrite_nb.testing.corpus, repeated past its ~1,300 tokens); the chat prompts go
through the model's own chat template (Engine.format_chat), so llama.cpp and the engine see exactly what a chat
user's request looks like.
tree_of_thought_deep's four turns follow SGLang's benchmark (plan, execute, reflect, final answer), reworded; its
questions are grade-school arithmetic word problems written here.
"""
from __future__ import annotations

from dendrite_nb import Engine
from dendrite_nb.testing.corpus import CORPUS

from .workloads import Texts

ASKS = ["Summarise the text above in one sentence.", "Which place does the text describe first?",
        "List three facts the text states.", "What is the tone of the text?",
        "Give the text a short title.", "Which sentence is the most surprising, and why?",
        "Explain the second paragraph to a child.", "What question does the text leave open?"]
CHAT_REQUEST = ("Give three short tips for staying focused while studying for an exam, one sentence each, and say "
                "which one matters most.")
QUESTIONS = ["A baker makes 48 rolls in the morning and 36 in the afternoon. She sells 5 bags of 12 rolls. "
             "How many rolls are left?",
             "Tom reads 14 pages a day for 6 days, then 20 pages a day for 3 days. The book has 180 pages. "
             "How many pages does he still have to read?",
             "A farmer has 7 rows of 23 apple trees. A storm knocks down 19 trees. How many trees stand?",
             "A train ticket costs 12 dollars for adults and 7 for children. What do 3 adults and 4 children pay?"]
TURNS = ["Sketch a high-level plan for solving the question below: name the method and the idea only, without "
         "doing any calculation, in at most 80 words. Question: ",
         "The plan is fine. Now do the calculation with the real numbers, step by step, following the plan, and "
         "give the final answer. Keep it short.",
         "Now check your own solution rigorously and score it from 1 to 5.",
         "After that check, would you change anything? Give the final answer."]
MARK = "\x00answer\x00"  # stands for a generated answer when cutting the template between turns


def make_texts(engine: Engine, document_tokens: int, instructions: int, moves: int) -> Texts:
    text = CORPUS
    while len(document := engine.encode(text, at_start=True)) < document_tokens:
        text += "\n\n" + CORPUS   # a long context for the fork-cost runs: its content does not matter there

    def chat(content: str) -> list[int]:
        return engine.encode(engine.format_chat([{"role": "user", "content": content}]), at_start=True)

    def after_answer(content: str) -> list[int]:
        """The tokens that close an answer and ask the next turn (the end-of-turn of the answer, the user turn, the
        assistant header): the template cut after a stand-in answer."""
        rendered = engine.format_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": MARK},
                                       {"role": "user", "content": content}])
        return engine.encode(rendered[rendered.index(MARK) + len(MARK):])

    return Texts(
        document=document[:document_tokens],
        instructions=[engine.encode(f"\n\nQuestion {i + 1}: {ASKS[i % len(ASKS)]}\nAnswer:")
                      for i in range(instructions)],
        chat_prompt=chat(CHAT_REQUEST),
        moves=[engine.encode(f"\nStep {i + 1}:") for i in range(moves)],
        plan_prompts=[chat(TURNS[0] + question) for question in QUESTIONS],
        deep_segments=[after_answer(turn) for turn in TURNS[1:]],
    )
