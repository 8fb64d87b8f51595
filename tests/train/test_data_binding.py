"""A run is bound to its data: its checkpoints record a fingerprint of the prepared data
(``archlab.io.run_dir.data_fingerprint``), and a resume on other tokens at the same ``data.path``
is refused with one line that writes nothing; checkpoints from before the fingerprint resume as
they always did."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

from archlab.io.run_dir import data_fingerprint
from archlab.train.trainer import train
from tests.conftest import SMALL, small_config
from tests.helpers import run_cli

EXTRA = ("train.steps=4", "train.ckpt_every=2", "train.eval_every=2")


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _other_corpus(folder: Path) -> Path:
    """About 120 KB of made-up sentences: text the run never saw."""
    rng = random.Random(7)
    words = ["river", "stone", "lantern", "orbit", "meadow", "copper", "signal", "harbor", "violet", "engine"]
    folder.mkdir()
    for i in range(30):
        lines = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(50)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return folder


def test_resuming_on_re_prepared_data_is_refused_and_the_advice_works(stdlib_data, tmp_path, capsys):
    data, out = tmp_path / "D", tmp_path / "run"
    shutil.copytree(stdlib_data, data)
    train(small_config(data, *EXTRA), out, stop_after_steps=2, show_progress=False)
    state = out / "ckpt" / "step_0000002" / "state.json"
    manifest = json.loads((data / "manifest.json").read_text())
    assert json.loads(state.read_text())["data"]["fingerprint"] == data_fingerprint(manifest)

    # D prepared again from another corpus, with the run's own tokenizer
    code, _, err = run_cli(capsys, "data", "prepare", "--source", str(_other_corpus(tmp_path / "other")),
                           "--tokenizer", str(out), "--out", str(data), "--overwrite", "--val-frac", "0.1")
    assert code == 0, err
    before = _snapshot(out)
    sets = [a for o in [*SMALL, f"data.path={data}", *EXTRA] for a in ("--set", o)]
    code, stdout, err = run_cli(capsys, "train", "--out", str(out), *sets)
    lines = err.strip().splitlines()
    assert code == 1 and stdout == "" and len(lines) == 1, err
    assert f"the data in {data} changed since {out} started (its train shards and its val shards differ" in lines[0]
    assert "train into a new --out" in lines[0] and f"put the original data back in {data}" in lines[0]
    assert _snapshot(out) == before  # nothing written

    # A checkpoint written before runs recorded their data resumes as it always did.
    recorded = state.read_text()
    legacy = json.loads(recorded)
    del legacy["data"]["fingerprint"]
    state.write_text(json.dumps(legacy))  # state.json is not among the files it checksums
    res = train(small_config(data, *EXTRA), out, stop_after_steps=1, show_progress=False)
    assert res.steps == 3
    state.write_text(recorded)

    # The advice works: the original data back at data.path (same source, same tokenizer) resumes.
    code, _, err = run_cli(capsys, "data", "prepare", "--source", "stdlib", "--max-mb", "0.6", "--tokenizer",
                           str(out), "--out", str(data), "--overwrite")
    assert code == 0, err
    code, stdout, err = run_cli(capsys, "train", "--out", str(out), *sets)
    assert code == 0 and f"resuming from step 2 of {out}" in err and "done: 4 steps" in stdout, err
