"""The two-hop generator and its ``prepare`` source: the graphs, the held-out queries, the corpus as
prepared (every training line in the train split, no test query anywhere), determinism, and one
token per name at the suite's settings."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from archlab.data import prepare
from archlab.data.tokenizer import EOS_ID, load_tokenizer
from archlab.data.twohop import (GENERATOR_VERSION, TASK_FILES, Benchmark, TwoHopOptions, generate,
                                 parse_spec)
from archlab.errors import ConfigError, UsageError
from tests.data.data_testutil import split_tokens
from tests.helpers import run_cli

# Small graphs: 2 x 30 entities, 6 relations, 3 facts each; 270 queries per graph (27 held out).
SMALL = TwoHopOptions(entities=30, relations=6, facts_per_entity=3, passes=3)
SMALL_SPEC = "twohop:entities=30,relations=6,facts_per_entity=3,passes=3"


def facts_table(bench: Benchmark) -> dict[tuple[str, str], str]:
    return {(f.subject, f.relation): f.object for f in bench.atomic_facts()}


def prepared_lines(data: Path, split: str) -> list[str]:
    """The lines of a prepared split, decoded document by document from its token shards."""
    tok = load_tokenizer(data / "tokenizer.json")
    ids = split_tokens(data, split).tolist()
    docs, start = [], 0
    for i, t in enumerate(ids):
        if t == EOS_ID:
            docs.append(tok.decode(ids[start:i]))
            start = i + 1
    assert start == len(ids)  # every document ends with <|endoftext|>
    return [line for doc in docs for line in doc.split("\n") if line]


def test_graphs_are_entity_disjoint_and_well_formed() -> None:
    bench = generate(SMALL)
    a, b = bench.graph_a, bench.graph_b
    assert len(a.entities) == len(b.entities) == 30 and not set(a.entities) & set(b.entities)
    assert len(set(a.entities + b.entities + bench.relations)) == 66  # no name is used twice
    for graph in (a, b):
        own = set(graph.entities)
        assert len(graph.facts) == 30 * 3
        for f in graph.facts:
            assert f.subject in own and f.object in own and f.object != f.subject
            assert f.relation in bench.relations
        per_subject: dict[str, list[str]] = {}
        for f in graph.facts:
            per_subject.setdefault(f.subject, []).append(f.relation)
        assert all(len(rels) == len(set(rels)) == 3 for rels in per_subject.values())
    # the relations are shared: both graphs use most of them
    assert len({f.relation for f in a.facts} & {f.relation for f in b.facts}) >= 5


def test_every_answer_follows_from_the_atomic_facts() -> None:
    bench = generate(SMALL)
    table = facts_table(bench)
    assert len(table) == len(bench.atomic_facts())  # one object per (subject, relation): one answer
    for q in bench.train_queries + bench.id_queries + bench.ood_queries:
        assert table[(q.subject, q.first)] == q.bridge
        assert table[(q.bridge, q.second)] == q.answer

    def keys(queries) -> set[tuple[str, str, str]]:
        return {(q.subject, q.first, q.second) for q in queries}

    a_entities, b_entities = set(bench.graph_a.entities), set(bench.graph_b.entities)
    # graph A's chains are split between training and the ID test, all of graph B's are OOD
    assert keys(bench.train_queries) | keys(bench.id_queries) == keys(bench.graph_a.queries())
    assert not keys(bench.train_queries) & keys(bench.id_queries)
    assert len(bench.id_queries) == round(0.1 * 270) and len(bench.ood_queries) == 270
    assert {q.subject for q in bench.train_queries + bench.id_queries} <= a_entities
    assert {q.subject for q in bench.ood_queries} <= b_entities
    # the test files hold the same queries: the context up to r2, the answer as target
    rows = bench.task_rows("id")
    assert [(r["context"], r["target"]) for r in rows] == \
        [(f"\n {q.subject} {q.first} {q.second}", q.answer) for q in bench.id_queries]


@pytest.mark.parametrize("seed,val_frac", [(0, 0.02), (1, 0.5), (2, 0.3)])
def test_prepared_corpus_holds_every_training_line_and_no_test_query(tmp_path, seed, val_frac) -> None:
    out = tmp_path / "data"
    prepare(SMALL_SPEC, out, vocab_size=600, seed=seed, val_frac=val_frac)
    bench = generate(SMALL)
    training = {line.rstrip("\n") for line in bench.training_lines()}
    train, val = prepared_lines(out, "train"), prepared_lines(out, "val")
    assert val, "the validation split is empty"
    # every atomic fact of both graphs and every training query reached the train split, whatever
    # chunks fell to validation ...
    assert training <= set(train)
    # ... and nothing else is in the corpus: no held-out or OOD query, with or without its answer
    assert set(train) | set(val) <= training
    prompts = {q.prompt().lstrip("\n") + " " for q in bench.id_queries + bench.ood_queries}
    text = "\n".join(train + val) + "\n"
    assert not [p for p in prompts if p in text]
    # the test splits are written beside the shards and named in the manifest
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["sources"][0]
    assert entry["fmt"] == "twohop" and entry["generator"]["version"] == GENERATOR_VERSION
    assert entry["counts"]["ood_queries"] == 270 and entry["counts"]["atomic_facts"] == 180
    for split, name in TASK_FILES.items():
        data = (out / name).read_bytes()
        assert data.decode() == bench.task_file(split)
        assert entry["task_files"][name] == hashlib.sha256(data).hexdigest()


def _fingerprint(options: TwoHopOptions) -> str:
    bench = generate(options)
    h = hashlib.sha256()
    for name, text in bench.documents():
        h.update(f"{name}\0{text}\0".encode())
    for split in TASK_FILES:
        h.update(bench.task_file(split).encode())
    return h.hexdigest()


def test_same_seed_same_bytes_different_seed_different_bytes(tmp_path) -> None:
    first, again, other = tmp_path / "first", tmp_path / "again", tmp_path / "other"
    prepare(SMALL_SPEC, first, vocab_size=600)
    prepare(SMALL_SPEC, again, vocab_size=600)
    prepare(SMALL_SPEC + ",seed=1", other, vocab_size=600)
    files = ["train_000.bin", "val_000.bin", "tokenizer.json", *TASK_FILES.values()]
    assert all((first / f).read_bytes() == (again / f).read_bytes() for f in files)
    assert all((first / f).read_bytes() != (other / f).read_bytes() for f in files)
    # another process, with other string hashing, generates the same bytes
    code = ("from archlab.data.twohop import TwoHopOptions; from tests.data.test_twohop "
            "import _fingerprint; print(_fingerprint(TwoHopOptions(entities=30, relations=6, "
            "facts_per_entity=3, passes=3)))")
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parents[2]).stdout.strip()
        assert got == _fingerprint(SMALL)
    # the passes reorder the corpus, not the graphs or the test splits
    more = generate(TwoHopOptions(entities=30, relations=6, facts_per_entity=3, passes=4))
    assert more.atomic_facts() == generate(SMALL).atomic_facts()
    assert more.task_file("ood") == generate(SMALL).task_file("ood")


def test_default_benchmark_is_pinned() -> None:
    """The default options' test splits, as the two-hop suite evaluates them: regenerated on the
    evaluating machine, they must be the bytes prepared elsewhere. A change here changes what a
    suite's prepared data and its generated tasks agree on: bump GENERATOR_VERSION with it."""
    bench = generate()
    assert bench.counts() == {"entities": 400, "relations": 20, "atomic_facts": 2000, "train_queries": 4500,
                              "id_queries": 500, "ood_queries": 5000}
    digests = {s: hashlib.sha256(bench.task_file(s).encode()).hexdigest()[:16] for s in TASK_FILES}
    assert digests == {"id": "56be863611b06f30", "ood": "1880ebfc1e838464"}


def test_every_name_is_one_token_at_the_suite_settings(tmp_path) -> None:
    from archlab.eval.harness import Scorer
    from archlab.lab.suite import load_suite

    suite = load_suite("two-hop")
    assert suite.data is not None and suite.data.source == "twohop" and suite.data.max_mb is None
    vocab = suite.base["model"]["vocab_size"]
    out = tmp_path / "data"
    prepare(suite.data.source, out, vocab_size=vocab)  # what the lab's data job runs
    tok = load_tokenizer(out / "tokenizer.json")
    bench = generate(parse_spec(suite.data.source))
    names = bench.graph_a.entities + bench.graph_b.entities + bench.relations
    assert [n for n in names if len(tok.encode(" " + n).ids) != 1] == []
    # a test item is scored as the training text reads: newline, three names, then one answer token
    scorer = Scorer(logits_fn=lambda x: x, tokenizer=tok, max_len=8)
    for row in bench.task_rows("id")[:50] + bench.task_rows("ood")[:50]:
        context, target = scorer.encode_pair(row["context"], " " + row["target"])
        assert len(context) == 4 and len(target) == 1
        line = row["context"].lstrip("\n") + " " + row["target"] + "\n"
        assert tok.encode("\n" + line).ids == context + target + tok.encode("\n").ids


def test_spec_options_and_one_line_errors(tmp_path, capsys) -> None:
    assert parse_spec("twohop") == TwoHopOptions()
    opts = parse_spec("twohop:seed=3, entities=50,id_test_frac=2e-1")
    assert (opts.seed, opts.entities, opts.id_test_frac) == (3, 50, 0.2)
    assert parse_spec(opts.spec()) == opts
    for spec, words in [("twohop:entitys=5", "unknown key 'entitys'"),
                        ("twohop:seed=x", "seed: expected int"),
                        ("twohop:facts_per_entity=7,relations=6", "facts_per_entity: must be in 1..relations=6"),
                        ("twohop:id_test_frac=1", "id_test_frac: must be in (0, 1)"),
                        ("twohop:entities=1", "entities: must be in 2..100000"),
                        ("twohop:seed=1,seed=2", "seed: given twice"),
                        ("twohop:seed", "seed: expected key=value")]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_spec(spec)
    out = tmp_path / "data"
    for argv, code, words in [(["--source", "twohop:entities=1"], 2, "entities: must be in 2..100000"),
                              (["--source", "twohop", "--max-mb", "1"], 2, "--max-mb"),
                              (["--source", "twohop", "--format", "text"], 2, "--format")]:
        got, _, err = run_cli(capsys, "data", "prepare", "--out", str(out), *argv)
        assert got == code and len(err.strip().splitlines()) == 1 and words in err, err
        assert not out.exists()
    with pytest.raises(UsageError, match="--encoding"):
        prepare("twohop", out, encoding="latin-1")


def test_prepare_refuses_a_side_file_that_would_overwrite_its_own(tmp_path) -> None:
    class Clobbering:
        spec, path = "clobbering", "memory"

        def documents(self):
            return generate(SMALL).documents()

        def describe(self):
            return {"spec": self.spec, "fmt": "test", "path": self.path}

        def side_files(self):
            return {"tokenizer.json": "{}"}

    with pytest.raises(ValueError, match="tokenizer.json"):
        prepare(Clobbering(), tmp_path / "data", vocab_size=600)
    assert not (tmp_path / "data").exists()
