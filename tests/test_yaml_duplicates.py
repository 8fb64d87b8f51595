"""A key given twice in one YAML mapping is refused (``archlab.config.UniqueKeyLoader``): in config
files and in suite files, with one line naming the file, the key and its lines. PyYAML alone keeps
the last value, so ``train: {lr: 1e-3, lr: 2e-3}`` trained at 2e-3."""

from __future__ import annotations

from pathlib import Path

import pytest

from archlab.config import load_yaml, make_config
from archlab.errors import ConfigError
from archlab.lab.suite import builtin_suites, load_suite
from tests.helpers import run_cli
from tests.lab.lab_fakes import SUITE_YAML

NESTED = "train: {lr: 1e-3, lr: 2e-3}\n"
SECTION = "train:\n  lr: 1e-3\nmodel:\n  d_model: 64\ntrain:\n  steps: 5\n"


@pytest.mark.parametrize("text,key,line,first", [(NESTED, "lr", 1, 1), (SECTION, "train", 5, 1)],
                         ids=["key-in-a-section", "top-level-section"])
def test_a_config_file_with_a_duplicate_key_is_one_line(tmp_path: Path, capsys, text, key, line, first) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    expected = f"config error: {path} line {line}: key '{key}' is given twice in one mapping (first on line {first})"
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")) as e:
        make_config("tiny", [path])
    assert "\n" not in str(e.value) and e.value.exit_code == 2
    code, out, err = run_cli(capsys, "config", "--config", str(path))
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err


def _line(text: str, start: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(start))


@pytest.mark.parametrize("text,key,start", [
    (SUITE_YAML.replace("eval: {last_k: 1}", "eval: {last_k: 1, last_k: 2}"), "last_k", "eval:"),
    (SUITE_YAML + "budget: {tokens: 40960, match: iso-token}\n", "budget", "budget:"),
], ids=["key-in-a-section", "top-level-section"])
def test_a_suite_file_with_a_duplicate_key_is_one_line(tmp_path: Path, text, key, start) -> None:
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    where = len(text.splitlines()) if key == "budget" else _line(text, start)  # the second one
    with pytest.raises(ConfigError, match=rf"^suite error: {path} line {where}: key '{key}' is given twice in one "
                                          rf"mapping \(first on line {_line(text, start)}\)") as e:
        load_suite(path)
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_merges_may_override_and_the_shipped_files_have_no_duplicates(tmp_path: Path) -> None:
    """A merge key (``<<: *anchor``) brings keys in to be overridden: not a duplicate."""
    path = tmp_path / "merge.yaml"
    path.write_text("defaults: &d {lr: 1e-3, steps: 4}\ntrain:\n  <<: *d\n  lr: 2e-3\n")
    assert load_yaml(path)["train"] == {"lr": "2e-3", "steps": 4}
    for name in builtin_suites():  # read through the same loader
        load_suite(name)
    for config in sorted(Path(__file__).resolve().parents[1].joinpath("configs").rglob("*.yaml")):
        load_yaml(config)
