"""Suite files and plans: the built-ins, budgets, run identity, and one-line errors (exit code 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from archlab.errors import ConfigError
from archlab.lab.plan import build_plan, select
from archlab.lab.suite import builtin_suites, load_suite, parse_suite
from tests.lab.lab_fakes import SUITE_YAML, fake_costs, write_suite

ROOT = Path(__file__).resolve().parents[2]


def test_builtin_suites_plan_cleanly(tmp_path: Path) -> None:
    assert {"default", "gpu-20m", "gpu-124m"} <= set(builtin_suites())
    for name in builtin_suites():
        suite = load_suite(name)
        plan = build_plan(suite, tmp_path / name, costs_fn=fake_costs)
        labels = {r.label for r in plan.runs}
        assert labels == {suite.baseline, *suite.variants}
        assert len([r for r in plan.runs if r.role == "baseline"]) >= 3
        assert len({r.run_id for r in plan.runs}) == len(plan.runs)


def test_default_suite_shape() -> None:
    """The README's main job: one cheap variant with 6 paired seeds (issue 32: an MDE under 0.05
    within about 10 CPU minutes), final losses of the final weights, a schedule that fits the run."""
    suite = load_suite("default")
    assert suite.preset == "tiny" and suite.data is not None and suite.data.source == "stdlib"
    assert suite.seeds.baseline == suite.seeds.variants == (0, 1, 2, 3, 4, 5) and suite.seeds.data is None
    assert set(suite.variants) == {"block-attnres"} and suite.eval.last_k == 1
    plan = build_plan(suite, Path("/tmp/x"), costs_fn=fake_costs)
    cfg = plan.runs[0].config
    assert cfg.train.device == "cpu" and cfg.train.warmup_steps is None and cfg.train.warmup == 10
    assert len(plan.runs) == 12 and sum(r.tokens for r in plan.runs) == 12 * 409600


def test_plan_budget_seeds_and_ids(tmp_path: Path) -> None:
    suite = load_suite(write_suite(tmp_path))
    plan = build_plan(suite, tmp_path / "out", costs_fn=fake_costs)
    assert [r.label for r in plan.runs][:3] == ["llama", "lower-init", "same"]  # interleaved by seed
    assert len(plan.runs) == 3 + 2 * 2
    for r in plan.runs:
        assert r.steps == 40 and r.tokens == 40 * 16 * 128
        assert r.config.train.seed == r.init_seed and r.config.data.seed == r.data_seed == 0
    lower = next(r for r in plan.runs if r.label == "lower-init")
    assert lower.config.model.init_std == 0.01
    # Same suite, same ids; a changed config (here via --set) gives new ids.
    again = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "out", costs_fn=fake_costs)
    assert [r.run_id for r in again.runs] == [r.run_id for r in plan.runs]
    changed = build_plan(suite, tmp_path / "out", ["train.lr=0.001"], costs_fn=fake_costs)
    assert all(r.config.train.lr == 0.001 for r in changed.runs)
    assert not {r.run_id for r in changed.runs} & {r.run_id for r in plan.runs}


def test_data_seed_follows_init(tmp_path: Path) -> None:
    text = SUITE_YAML.replace("variants: [0, 1]}", "variants: [0, 1], data: init}")
    plan = build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o", costs_fn=fake_costs)
    assert all(r.data_seed == r.init_seed == r.config.data.seed for r in plan.runs)


def test_iso_flop_scales_tokens_by_training_flops(tmp_path: Path) -> None:
    text = SUITE_YAML.replace("iso-token", "iso-flop").replace(
        "  same: {model.rope_theta: 5000.0}", "  branch: {model.branch.enabled: true}")
    plan = build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o", costs_fn=fake_costs)
    base = next(r for r in plan.runs if r.label == "llama")
    branch = next(r for r in plan.runs if r.label == "branch")
    ratio = base.costs["train_flops_per_token"] / branch.costs["train_flops_per_token"]
    assert ratio == pytest.approx(0.5)
    assert branch.steps == round(81920 * ratio / 2048) == 20
    assert base.steps == 40
    # The shorter run keeps its schedule's shape: warm-up and evaluations at the same fractions.
    assert (base.config.train.warmup_steps, base.config.train.eval_every) == (2, 5)
    assert (branch.config.train.warmup_steps, branch.config.train.eval_every) == (1, 2)


def test_a_variant_can_name_its_own_matching(tmp_path: Path) -> None:
    """One suite holds the decode branch iso-token and iso-FLOP against the same baseline runs."""
    text = SUITE_YAML.replace(
        "  same: {model.rope_theta: 5000.0}",
        "  branch: {model.branch.enabled: true}\n"
        "  branch-isoflop: {model.branch.enabled: true, budget.match: iso-flop}")
    suite = load_suite(write_suite(tmp_path, text))
    assert suite.budget.match_for("branch-isoflop") == "iso-flop" and suite.budget.match_for("branch") == "iso-token"
    assert "budget.match" not in suite.variants["branch-isoflop"]  # not a config key
    assert suite.to_dict()["budget"]["variant_match"] == {"branch-isoflop": "iso-flop"}
    plan = build_plan(suite, tmp_path / "o", costs_fn=fake_costs)
    steps = {r.label: r.steps for r in plan.runs}
    assert steps == {"llama": 40, "lower-init": 40, "branch": 40, "branch-isoflop": 20}
    # A suite without per-variant matching stores its budget as before.
    assert "variant_match" not in load_suite(write_suite(tmp_path)).to_dict()["budget"]


@pytest.mark.parametrize("overrides, message", [
    ("{model.branch.enabled: true, budget.match: iso-bytes}",
     "variants.b.budget.match: must be one of iso-token, iso-flop, got 'iso-bytes'"),
    ("{budget.tokens: 5}", "only budget.match can be set per variant"),
])
def test_bad_per_variant_matching_is_one_line(tmp_path: Path, overrides: str, message: str) -> None:
    text = SUITE_YAML.replace("  same: {model.rope_theta: 5000.0}", f"  b: {overrides}")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("'", "'")) as e:
        load_suite(write_suite(tmp_path, text))
    assert "\n" not in str(e.value)


def test_managed_data_path_is_inside_the_suite_dir_and_portable(tmp_path: Path) -> None:
    text = SUITE_YAML.replace("  data: {path: /nonexistent-data}\n", "").replace(
        "budget:", "data: {source: stdlib, max_mb: 2}\nbudget:")
    suite = load_suite(write_suite(tmp_path, text))
    a = build_plan(suite, tmp_path / "a", costs_fn=fake_costs)
    b = build_plan(suite, tmp_path / "b", costs_fn=fake_costs)
    assert a.runs[0].config.data.path == str((tmp_path / "a" / "data" / "stdlib-2MB-v4096").resolve())
    assert [j.max_bytes for j in a.data_jobs] == [2_000_000]
    assert [r.run_id for r in a.runs] == [r.run_id for r in b.runs]  # a moved suite keeps its ids
    # Other data (size or source) is another directory, hence other runs.
    bigger = build_plan(load_suite(write_suite(tmp_path, text.replace("max_mb: 2", "max_mb: 0"))),
                        tmp_path / "a", costs_fn=fake_costs)
    assert bigger.runs[0].config.data.path.endswith("/data/stdlib-all-v4096")
    assert not {r.run_id for r in bigger.runs} & {r.run_id for r in a.runs}
    files = build_plan(load_suite(write_suite(tmp_path, text.replace("source: stdlib", "source: '/corpus/*.txt'"))),
                       tmp_path / "a", costs_fn=fake_costs)
    name = Path(files.runs[0].config.data.path).name
    assert name.startswith("corpus_.txt-") and name.endswith("-2MB-v4096") and "/" not in name


def _with_eval(extra: str) -> str:
    return SUITE_YAML.replace("eval: {last_k: 1}", "eval: {last_k: 1, " + extra + "}")


def test_downstream_eval_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_suite(write_suite(tmp_path)).eval.tasks == ()  # default: no downstream evaluation
    sub = tmp_path / "suites"
    sub.mkdir()
    suite = load_suite(write_suite(sub, _with_eval("tasks: [piqa, lambada], task_dir: ../olmo, limit: 50")))
    assert suite.eval.tasks == ("piqa", "lambada") and suite.eval.limit == 50
    assert Path(suite.eval.task_dir).resolve() == (tmp_path / "olmo").resolve()  # relative to the suite file
    stored = suite.to_dict()["eval"]
    assert stored["tasks"] == ["piqa", "lambada"] and stored["limit"] == 50 and isinstance(stored["task_dir"], str)
    suite = load_suite(write_suite(sub, _with_eval("tasks: ' hellaswag,arc_easy , winogrande'")))
    assert suite.eval.tasks == ("hellaswag", "arc_easy", "winogrande")
    assert suite.eval.task_dir is None and suite.eval.limit is None  # $ARCHLAB_TASK_DIR, every item
    assert load_suite(write_suite(sub, _with_eval(f"tasks: piqa, task_dir: {tmp_path}"))).eval.task_dir == str(tmp_path)
    # A built-in suite (no file directory) resolves against the working directory.
    monkeypatch.chdir(tmp_path)
    data = {"budget": {"tokens": 1000}, "eval": {"tasks": ["piqa"], "task_dir": "t"}}
    assert parse_suite(data, origin="built-in suite x", default_name="x").eval.task_dir == str(tmp_path / "t")
    # Tasks do not change what is trained: the same run ids with or without them.
    with_tasks = build_plan(suite, tmp_path / "o", costs_fn=fake_costs)
    without = build_plan(load_suite(write_suite(sub)), tmp_path / "o", costs_fn=fake_costs)
    assert [r.run_id for r in with_tasks.runs] == [r.run_id for r in without.runs]


def test_float_spellings_and_null_defaults(tmp_path: Path) -> None:
    """Suite files read numbers as configs do: ``5e-2`` (a string to PyYAML) is a float; a key
    written without a value keeps its default."""
    text = (SUITE_YAML.replace("eval: {last_k: 1}", "eval: {last_k: 1, alpha: 5e-2, every:}")
            + "estimate: {tokens_per_s: 9e3}\ncosts:\n  context:\n")
    suite = load_suite(write_suite(tmp_path, text))
    assert suite.eval.alpha == 0.05 and isinstance(suite.eval.alpha, float)
    assert suite.tokens_per_s == 9000.0 and suite.eval.every is None
    assert suite.costs.context is None and suite.costs.dtype_bytes == 2
    managed = SUITE_YAML.replace("  data: {path: /nonexistent-data}\n", "").replace(
        "budget:", "data: {source: stdlib, max_mb: 25e-1}\nbudget:")
    assert load_suite(write_suite(tmp_path, managed)).data.max_mb == 2.5


def test_select_variants(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "o", costs_fn=fake_costs)
    assert {r.label for r in select(plan, ["same"])} == {"llama", "same"}
    with pytest.raises(ConfigError, match="unknown variant 'nope'"):
        select(plan, ["nope"])


BAD = [
    ("budget: {tokens: [1, 2\n", "not valid YAML"),
    ("name: nobudget\n", "budget: is required"),
    (SUITE_YAML.replace("budget:", "bugdet:"), "bugdet: unknown key"),
    (SUITE_YAML.replace("match: iso-token", "match: iso-time"), "budget.match: must be one of"),
    (_with_eval("families: {a: [piqa]}"), "eval.families: applies to eval.tasks"),
    (_with_eval("tasks: [piqa, lambada], families: {a: [piqa]}"), "eval.families: task 'lambada' of eval.tasks is in no family"),
    (_with_eval("tasks: [piqa, lambada], families: {a: [piqa], b: [piqa, lambada]}"),
     "eval.families: task 'piqa' is in more than one family"),
    (_with_eval("tasks: [piqa], families: {a: [hellaswag]}"), "eval.families.a: 'hellaswag' is not one of eval.tasks"),
    (_with_eval("final_tokens: 0"), "eval.final_tokens: must be positive"),
    (SUITE_YAML.replace("tokens: 81920", "tokens: lots"), "budget.tokens: expected a number of tokens with an "
                                                           "optional k/M/G suffix (e.g. 6.5M), got 'lots'"),
    (SUITE_YAML.replace("tokens: 81920", "tokens: []"), "budget.tokens: is an empty list"),
    (SUITE_YAML.replace("tokens: 81920", "tokens: [1M, 1000k]"), "budget.tokens: has repeated budgets"),
    (SUITE_YAML.replace("tokens: 81920", "tokens: -3"), "budget.tokens: must be at least 1 token"),
    (SUITE_YAML.replace("tokens: 81920", "tokens: {a: 1}"), "budget.tokens: expected a number of tokens"),
    (SUITE_YAML.replace("baseline: [0, 1, 2]", "baseline: [0, 0]"), "seeds.baseline: has repeated"),
    (SUITE_YAML.replace("model.init_std: 0.01", "model.init_sdt: 0.01"),
     "variants.lower-init: config error: unknown key 'model.init_sdt'"),
    (SUITE_YAML.replace("model.init_std: 0.01", "model.init_std: tiny"),
     "variants.lower-init: config error: model.init_std: expected float"),
    (SUITE_YAML.replace("model.init_std: 0.01", "train.seed: 4"), "train.seed is set by the suite"),
    (SUITE_YAML.replace("tokens: 81920", "tokens: 2048"), "warmup_steps"),
    (SUITE_YAML.replace("  same:", "  llama:"), "cannot share the baseline's name"),
    (SUITE_YAML.replace("  data: {path: /nonexistent-data}\n", "").replace(
        "budget:", "data: {recipe: en-mix, source: stdlib}\nbudget:"), "data.recipe: give either source or recipe"),
    (SUITE_YAML.replace("  data: {path: /nonexistent-data}\n", "").replace(
        "budget:", "data: {recipe: en-mixx}\nbudget:"), "data.recipe: unknown recipe 'en-mixx'"),
    (_with_eval("tasks: [piqa, mmlu]"), "eval.tasks: unknown task 'mmlu'; known tasks: hellaswag, piqa"),
    (_with_eval("tasks: 'piqa,mmlu'"), "eval.tasks: unknown task 'mmlu'"),
    (_with_eval("tasks: [piqa, 3]"), "eval.tasks: expected task names"),
    (_with_eval("tasks: {piqa: 1}"), "eval.tasks: expected list or str"),
    (_with_eval("tasks: [piqa, piqa]"), "eval.tasks: has repeated tasks"),
    (_with_eval("tasks: [piqa], limit: 0"), "eval.limit: must be positive"),
    (_with_eval("tasks: [piqa], limit: 2.5"), "eval.limit: expected int"),
    (_with_eval("tasks: [piqa], task_dir: 7"), "eval.task_dir: expected str"),
    (_with_eval("limit: 10"), "eval.limit: applies to eval.tasks"),
    (_with_eval("task_dir: olmo"), "eval.task_dir: applies to eval.tasks"),
    (_with_eval("taks: [piqa]"), "eval.taks: unknown key; allowed here: every, batches, final_tokens, last_k, alpha, tasks"),
    (SUITE_YAML.replace("match: iso-token", "mach: iso-token"), "budget.mach: unknown key; allowed here: tokens, match"),
    (SUITE_YAML.replace("baseline: [0, 1, 2]", "baseline: [0, one]"), "seeds.baseline[1]: expected int, got 'one'"),
    (SUITE_YAML.replace("baseline: [0, 1, 2]", "baseline: [0, -1]"), "seeds.baseline: expected a non-empty list"),
    (_with_eval("alpha: 5e+1"), "eval.alpha: must be in (0, 1), got 50.0"),
    (_with_eval("alpha: lots"), "eval.alpha: expected float, got 'lots'"),
    (SUITE_YAML.replace("budget: {tokens: 81920, match: iso-token}", "budget: {match: iso-token}"),
     "budget.tokens: is required"),
    (SUITE_YAML + "costs: {dtype_bytes: 0}\n", "costs.dtype_bytes: must be positive, got 0"),
    (SUITE_YAML + "estimate: 9000\n", "estimate: expected a mapping, got 9000"),
    ("- a\n- list\n", "must hold a mapping at the top level"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_malformed_suites_fail_with_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o", costs_fn=fake_costs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.exit_code == 2


def test_unknown_builtin_suite() -> None:
    with pytest.raises(ConfigError, match="unknown suite 'nope'; built-in: .*default"):
        load_suite("nope")


@pytest.mark.parametrize("text,message", [BAD[1], BAD[5]])
def test_cli_exit_code_2_and_one_line(tmp_path: Path, text: str, message: str) -> None:
    """Through the real entry point: a malformed suite or unknown variant key is one line, exit 2,
    and nothing is written."""
    path = write_suite(tmp_path, text)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from archlab.cli import main; sys.exit(main())",
         "compare", str(path), "--out", str(out)],
        capture_output=True, text=True, env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()
