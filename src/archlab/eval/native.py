"""How each known task's own fields become items (the lm-evaluation-harness conventions, listed in
``archlab.eval.tasks``' docstring), and the uniform fields any task may use instead."""

from __future__ import annotations

import os
import re

from archlab.errors import DataError
from archlab.eval.items import LambadaItem, MCItem, Row, check_gold


# ---- native field mappings ----------------------------------------------------------------------
_TAG = re.compile(r"\[.*?\]")


def hellaswag_preprocess(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = _TAG.sub("", text)
    return text.replace("  ", " ")


def hellaswag(row: Row) -> MCItem:
    ctx = row.str("ctx_a") + " " + row.str("ctx_b").capitalize()
    context = hellaswag_preprocess(row.str("activity_label") + ": " + ctx)
    endings = row.strs("endings", 2)
    gold = check_gold(row, row.int("label"), len(endings), "label")
    return MCItem(context, tuple(" " + hellaswag_preprocess(e) for e in endings), gold)


def piqa(row: Row) -> MCItem:
    sols = (row.str("sol1"), row.str("sol2"))
    gold = check_gold(row, row.int("label"), 2, "label")
    return MCItem(f"Question: {row.str('goal')}\nAnswer:", tuple(" " + s for s in sols), gold)


def arc(row: Row) -> MCItem:
    choices = row.sub("choices")
    texts, labels = choices.strs("text", 2), choices.strs("label", 2)
    if len(texts) != len(labels):
        raise DataError(f"{row.where}: field 'choices' has {len(texts)} texts but {len(labels)} labels")
    key = row.str("answerKey").strip()
    if key not in labels:
        raise DataError(f"{row.where}: field 'answerKey' is {key!r}, not one of the choice labels {labels}")
    return MCItem(f"Question: {row.str('question')}\nAnswer:", tuple(" " + t for t in texts), labels.index(key))


def winogrande(row: Row) -> MCItem:
    sentence = row.str("sentence")
    blank = sentence.find("_")
    if blank < 0:
        raise DataError(f"{row.where}: field 'sentence' has no '_' blank: {sentence[:60]!r}")
    options = (row.str("option1"), row.str("option2"))
    gold = check_gold(row, row.int("answer") - 1, 2, "answer")
    prefix = sentence[:blank]
    rest = " " + sentence[blank + 1:].strip()
    return MCItem(prefix, (rest, rest), gold, contexts=tuple(prefix + o for o in options))


def lambada(row: Row) -> LambadaItem:
    text = row.str("text").strip()
    if " " not in text:
        raise DataError(f"{row.where}: field 'text' has no space to split off a last word")
    context, word = text.rsplit(" ", 1)
    return LambadaItem(context, word)


def sciq(row: Row) -> MCItem:
    choices = tuple(" " + row.str(k) for k in ("distractor1", "distractor2", "distractor3", "correct_answer"))
    support = row.data.get("support") or ""  # empty in a fifth of the items
    return MCItem(f"{support.lstrip()}\nQuestion: {row.str('question')}\nAnswer:", choices, 3)


def copa(row: Row) -> MCItem:
    connector = {"cause": "because", "effect": "therefore"}.get(row.str("question"))
    if connector is None:
        raise DataError(f"{row.where}: field 'question' is {row.data['question']!r}, not 'cause' or 'effect'")
    # the premise's full stop gives way to the connector; a choice continues the sentence, so it
    # loses its capital
    premise = row.str("premise").strip()[:-1]
    choices = tuple(" " + c[:1].lower() + c[1:] for c in (row.str("choice1"), row.str("choice2")))
    return MCItem(f"{premise} {connector}", choices, check_gold(row, row.int("label"), 2, "label"))


def openbookqa(row: Row) -> MCItem:
    choices = row.sub("choices")
    texts, labels = choices.strs("text", 2), choices.strs("label", 2)
    key = row.str("answerKey").strip()
    if key not in labels:
        raise DataError(f"{row.where}: field 'answerKey' is {key!r}, not one of the choice labels {labels}")
    return MCItem(row.str("question_stem"), tuple(" " + t for t in texts), labels.index(key))


# ---- uniform fields -------------------------------------------------------------------------------
def uniform_mc(row: Row) -> MCItem:
    conts = row.strs("continuations", 2)
    ctx = row.get("context")
    contexts = None
    if isinstance(ctx, list):
        contexts = tuple(row.strs("context"))
        if len(contexts) != len(conts):
            raise DataError(f"{row.where}: field 'context' has {len(contexts)} entries for "
                            f"{len(conts)} continuations")
        ctx = os.path.commonprefix(list(contexts))
    elif not isinstance(ctx, str):
        raise DataError(f"{row.where}: field 'context' must be a string or a list of strings")
    return MCItem(ctx, tuple(conts), check_gold(row, row.int("gold"), len(conts), "gold"), contexts)


def uniform_lambada(row: Row) -> LambadaItem:
    target = row.str("target").strip()
    if not target:
        raise DataError(f"{row.where}: field 'target' is empty")
    return LambadaItem(row.str("context"), target)
