"""The two-hop fact-composition benchmark (arXiv 2607.00341's task), generated from a seed.

Two knowledge graphs, A and B, with disjoint entities and one shared set of relations. Every
entity has ``facts_per_entity`` atomic facts ``(subject, relation, object)`` with distinct
relations and an object from its own graph, so a relation is a function on the entities that have
it. A two-hop query ``(e, r1, r2)`` asks for ``r2(r1(e))``; its answer is implied by two atomic
facts, and there is one query for every chain, ``entities * facts_per_entity**2`` per graph.

The training corpus holds every atomic fact of both graphs and the two-hop queries of graph A
except a held-out ``id_test_frac`` of them. The held-out A queries test composition in
distribution (``twohop_id``); all B queries test it out of distribution (``twohop_ood``): the
model saw B's facts but never a B query, so only a composition rule that works on any entity
answers them. No test query is in the corpus, with or without its answer.

Surface text: one line per fact or query, every name preceded by a space, ``" bako Semu tiru\\n"``
and ``" bako Semu Lofa ruke\\n"``. Names are letters only (consonant-vowel syllables; relations
capitalised), so the byte-level BPE's pre-tokenizer keeps each name (with its space) as one
pre-token and, when the vocabulary has room for all of them (``archlab data prepare`` at the
two-hop suite's size does; the tests check it), learns each as one token. A test item's context
is ``"\\n bako Semu Lofa"`` (the newline that precedes every line in training) and its target
the answer, scored as LAMBADA is: right when the answer's tokens are the greedy argmax.

The corpus is ``passes`` shuffled orders of the training lines. Each order is cut into groups of
at most ``CHUNK_BYTES`` bytes, and every group is written twice in a row, as two documents with
the lines in two different orders. ``prepare`` cuts nothing from documents that small and sends
isolated chunks to validation (every ``1/val_frac``-th one: two neighbours are never both
validation while ``val_frac <= 0.5``), so every line is in the training split at least once
per pass whatever the split seed; the validation split holds reordered copies of training
lines. The twin is shuffled, not copied, so a window spanning both documents cannot recite the
first order back.

Determinism: every random choice comes from ``random.Random(key).random()``, seeded with a
string per purpose (names, each graph, the held-out split, each pass). Python guarantees that
method's sequence across versions, unlike ``shuffle``, ``sample`` or ``randrange``, so the same
options give the same bytes on any machine, and the evaluation can regenerate what another
machine prepared. Each purpose has its own stream, so that ``passes`` does not change the
graphs and the graphs do not depend on the corpus order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import yaml

from archlab.data.decoding import DEFAULT_ENCODING
from archlab.data.prepare import CHUNK_BYTES
from archlab.errors import DataError, UsageError
from archlab.typed import Reporter, build, check

SOURCE_NAME = "twohop"
# Bumped whenever the same options would give other bytes: recorded in the manifest, so prepared
# data can be told from what the current code generates.
GENERATOR_VERSION = 1
SPLITS = ("id", "ood")
TASK_FILES = {"id": "twohop_id.jsonl", "ood": "twohop_ood.jsonl"}

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)  # 70
_REPORTER = Reporter(f"data source {SOURCE_NAME}: ")


@dataclass(frozen=True)
class TwoHopOptions:
    """What the benchmark is generated from; ``twohop:key=value,...`` sets them for ``prepare``.

    The defaults are sized for the two-hop suite, a ~20M-parameter model trained for a few
    minutes on one GPU: 2 x 200 entities and 20 relations give 2,000 atomic facts (420 names, so
    a BPE of 1024 tokens holds each as one token), 5,000 two-hop queries per graph, 4,500 of them
    trained (4.5 inferred facts per atomic fact of A: Wang et al. 2024 found composition learned
    faster the higher that ratio), and test sets of 500 (ID) and 5,000 (OOD) queries. One pass
    over the training lines is about 30.5k tokens, so a run of tens of millions of tokens sees
    every fact hundreds of times: memorising the facts is not what limits it. The paper's sizes
    are not known; every size is an option.
    """

    seed: int = 0
    entities: int = 200  # per graph
    relations: int = 20  # shared by both graphs
    facts_per_entity: int = 5  # distinct relations per entity (its out-degree)
    id_test_frac: float = 0.1  # of graph A's two-hop queries, held out as the ID test
    passes: int = 4  # shuffled orders of the training lines in the corpus

    def validate(self) -> "TwoHopOptions":
        check(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}", _REPORTER)
        check(2 <= self.entities <= 100_000, "entities",
              f"must be in 2..100000 (an object differs from its subject), got {self.entities}", _REPORTER)
        check(1 <= self.relations <= len(_SYLLABLES) ** 2 // 2, "relations",
              f"must be in 1..{len(_SYLLABLES) ** 2 // 2}, got {self.relations}", _REPORTER)
        check(1 <= self.facts_per_entity <= self.relations, "facts_per_entity",
              f"must be in 1..relations={self.relations} (an entity's relations are distinct), got "
              f"{self.facts_per_entity}", _REPORTER)
        check(0 < self.id_test_frac < 1, "id_test_frac", f"must be in (0, 1), got {self.id_test_frac}",
              _REPORTER)
        held = round(self.id_test_frac * self.queries_per_graph)
        check(0 < held < self.queries_per_graph, "id_test_frac",
              f"holds out {held} of graph A's {self.queries_per_graph} queries; at least one must be held "
              "out and one trained", _REPORTER)
        check(1 <= self.passes <= 1000, "passes", f"must be in 1..1000, got {self.passes}", _REPORTER)
        return self

    @property
    def queries_per_graph(self) -> int:
        return self.entities * self.facts_per_entity ** 2

    def spec(self) -> str:
        """The canonical source spec, every option spelled out."""
        return SOURCE_NAME + ":" + ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def is_twohop_spec(spec: str) -> bool:
    return spec == SOURCE_NAME or spec.startswith(SOURCE_NAME + ":")


def parse_spec(spec: str) -> TwoHopOptions:
    """``twohop`` or ``twohop:seed=1,entities=300`` -> checked options (one line on a bad one)."""
    if not is_twohop_spec(spec):
        raise DataError(f"{spec!r} is not a {SOURCE_NAME} source spec")
    _, _, rest = spec.partition(":")
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        name, eq, raw = part.partition("=")
        check(bool(eq and name.strip() and raw.strip()), part, "expected key=value", _REPORTER)
        check(name.strip() not in values, name.strip(), "given twice", _REPORTER)
        try:
            values[name.strip()] = yaml.safe_load(raw)  # numbers as in --set: 0.1, 1e-1, 300
        except yaml.YAMLError:
            values[name.strip()] = raw
    return build(TwoHopOptions, values, reporter=_REPORTER).validate()


# ---- the graphs ---------------------------------------------------------------------------------
class _Draw:
    """Choices from one seeded stream, made only through ``random()`` (see the module docstring)."""

    def __init__(self, options: TwoHopOptions, purpose: str) -> None:
        self._random = random.Random(f"archlab-twohop:{options.seed}:{purpose}").random

    def below(self, n: int) -> int:
        return min(int(self._random() * n), n - 1)

    def shuffle(self, items: list[Any]) -> list[Any]:
        """``items`` in a random order (a new list; Fisher-Yates)."""
        out = list(items)
        for i in range(len(out) - 1, 0, -1):
            j = self.below(i + 1)
            out[i], out[j] = out[j], out[i]
        return out

    def pick(self, n: int, k: int) -> list[int]:
        """``k`` distinct indices below ``n``, in the order drawn."""
        chosen: list[int] = []
        taken: set[int] = set()
        while len(chosen) < k:
            i = self.below(n)
            if i not in taken:
                taken.add(i)
                chosen.append(i)
        return chosen


@dataclass(frozen=True)
class Fact:
    subject: str
    relation: str
    object: str

    def line(self) -> str:
        return f" {self.subject} {self.relation} {self.object}\n"


@dataclass(frozen=True)
class Query:
    subject: str
    first: str  # r1, applied to the subject
    second: str  # r2, applied to the bridge
    bridge: str  # r1(subject)
    answer: str  # r2(bridge)

    def prompt(self) -> str:
        """The test context: the line up to the answer, after the newline that precedes it."""
        return f"\n {self.subject} {self.first} {self.second}"

    def line(self) -> str:
        return f" {self.subject} {self.first} {self.second} {self.answer}\n"


@dataclass(frozen=True)
class Graph:
    entities: tuple[str, ...]
    facts: tuple[Fact, ...]

    def queries(self) -> list[Query]:
        """Every two-hop chain, in fact order: for each fact (e, r1, b), each fact of b."""
        out_facts: dict[str, list[Fact]] = {}
        for f in self.facts:
            out_facts.setdefault(f.subject, []).append(f)
        return [Query(f.subject, f.relation, g.relation, f.object, g.object)
                for f in self.facts for g in out_facts[f.object]]


def _names(count: int, syllables: int, draw: _Draw, capital: bool = False) -> list[str]:
    pool = len(_SYLLABLES) ** syllables
    names = []
    for index in draw.pick(pool, count):
        parts = []
        for _ in range(syllables):
            index, s = divmod(index, len(_SYLLABLES))
            parts.append(_SYLLABLES[s])
        name = "".join(parts)
        names.append(name.capitalize() if capital else name)
    return names


def _entity_syllables(n_names: int) -> int:
    """The fewest syllables (at least 2) whose pool is at least twice the names drawn: short
    names need few BPE merges, and the drawing does not crowd a nearly full pool."""
    k = 2
    while len(_SYLLABLES) ** k < 2 * n_names:
        k += 1
    return k


def _graph(options: TwoHopOptions, entities: list[str], relations: list[str], which: str) -> Graph:
    draw = _Draw(options, f"graph-{which}")
    n = len(entities)
    facts = []
    for i, subject in enumerate(entities):
        for r in draw.pick(len(relations), options.facts_per_entity):
            j = draw.below(n - 1)  # any other entity of the graph: no fact points at its subject
            facts.append(Fact(subject, relations[r], entities[j + (j >= i)]))
    return Graph(tuple(entities), tuple(facts))


@dataclass(frozen=True)
class Benchmark:
    """The generated graphs, the query split and the corpus built from them."""

    options: TwoHopOptions
    relations: tuple[str, ...]
    graph_a: Graph
    graph_b: Graph
    train_queries: tuple[Query, ...]  # graph A, in the corpus
    id_queries: tuple[Query, ...]  # graph A, held out
    ood_queries: tuple[Query, ...]  # graph B, all of them

    def atomic_facts(self) -> tuple[Fact, ...]:
        return self.graph_a.facts + self.graph_b.facts

    def training_lines(self) -> list[str]:
        return [f.line() for f in self.atomic_facts()] + [q.line() for q in self.train_queries]

    def test_queries(self, split: str) -> tuple[Query, ...]:
        if split not in SPLITS:
            raise DataError(f"unknown two-hop test split {split!r}; allowed: {', '.join(SPLITS)}")
        return self.id_queries if split == "id" else self.ood_queries

    def documents(self) -> Iterator[tuple[str, str]]:
        """The corpus: per pass, groups of shuffled lines, each written as twin documents."""
        for p in range(self.options.passes):
            draw = _Draw(self.options, f"pass-{p}")
            for g, group in enumerate(_groups(draw.shuffle(self.training_lines()), CHUNK_BYTES)):
                yield f"{SOURCE_NAME}/pass{p}/group{g}/a", "".join(group)
                yield f"{SOURCE_NAME}/pass{p}/group{g}/b", "".join(draw.shuffle(group))

    def task_rows(self, split: str) -> list[dict[str, str]]:
        """A test split as uniform LAMBADA-style items: ``{"context", "target"}``."""
        return [{"context": q.prompt(), "target": q.answer} for q in self.test_queries(split)]

    def task_file(self, split: str) -> str:
        """The test split as JSONL, one item a line (what ``prepare`` writes beside the shards)."""
        return "".join(json.dumps(row) + "\n" for row in self.task_rows(split))

    def counts(self) -> dict[str, int]:
        return {"entities": 2 * self.options.entities, "relations": len(self.relations),
                "atomic_facts": len(self.atomic_facts()), "train_queries": len(self.train_queries),
                "id_queries": len(self.id_queries), "ood_queries": len(self.ood_queries)}


def _groups(lines: list[str], limit: int) -> Iterator[list[str]]:
    """Consecutive lines packed greedily into groups of at most ``limit`` bytes (ASCII text)."""
    group: list[str] = []
    size = 0
    for line in lines:
        if group and size + len(line) > limit:
            yield group
            group, size = [], 0
        group.append(line)
        size += len(line)
    if group:
        yield group


@functools.lru_cache(maxsize=4)
def generate(options: TwoHopOptions = TwoHopOptions()) -> Benchmark:
    """The benchmark of ``options`` (checked); the same options always give the same benchmark."""
    options.validate()
    names = _Draw(options, "names")
    relations = _names(options.relations, 2, names, capital=True)
    entities = _names(2 * options.entities, _entity_syllables(2 * options.entities), names)
    graph_a = _graph(options, entities[:options.entities], relations, "a")
    graph_b = _graph(options, entities[options.entities:], relations, "b")
    queries_a = _Draw(options, "id-split").shuffle(graph_a.queries())
    held = round(options.id_test_frac * len(queries_a))
    ood = _Draw(options, "ood-order").shuffle(graph_b.queries())
    return Benchmark(options, tuple(relations), graph_a, graph_b, train_queries=tuple(queries_a[held:]),
                     id_queries=tuple(queries_a[:held]), ood_queries=tuple(ood))


# ---- the data source ----------------------------------------------------------------------------
class TwoHopSource:
    """``prepare``'s source for ``twohop[:options]``: the corpus as documents, and the test
    splits as files written into the prepared directory (``side_files``)."""

    fmt = SOURCE_NAME

    def __init__(self, spec: str, options: TwoHopOptions) -> None:
        self.spec = spec
        self.options = options
        self.path = options.spec()  # what the manifest and the summary show as the source's location
        self.benchmark = generate(options)

    def documents(self) -> Iterator[tuple[str, str]]:
        return self.benchmark.documents()

    def side_files(self) -> dict[str, str]:
        return {TASK_FILES[s]: self.benchmark.task_file(s) for s in SPLITS}

    def describe(self) -> dict[str, Any]:
        files = self.side_files()
        return {
            "spec": self.spec, "fmt": self.fmt, "path": self.path, "max_bytes": None,
            "generator": {"version": GENERATOR_VERSION, **asdict(self.options)},
            "counts": self.benchmark.counts(),
            "task_files": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()},
        }


def open_twohop(spec: str, *, fmt: str = "auto", field: str = "text", split: str = "train",
                max_bytes: int | None = None, encoding: str = DEFAULT_ENCODING) -> TwoHopSource:
    """The two-hop source of ``spec``; the reading options of file sources do not apply to it."""
    given = [flag for flag, value, default in (("--format", fmt, "auto"), ("--field", field, "text"),
                                               ("--split", split, "train"),
                                               ("--encoding", encoding, DEFAULT_ENCODING))
             if value != default]
    if max_bytes:  # a prefix of the corpus would drop facts: the guarantee above needs all of it
        given.append("--max-mb (a suite's data.max_mb)")
    if given:
        verb = "does" if len(given) == 1 else "do"
        raise UsageError(f"{', '.join(given)} {verb} not apply to the generated {SOURCE_NAME} source (it "
                         f"is sized by its own options: {SOURCE_NAME}:entities=...,passes=...)")
    return TwoHopSource(spec, parse_spec(spec))
