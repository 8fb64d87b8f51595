"""Reports: written from the database alone, figures inline in the HTML, verdicts as expected."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console

from archlab.lab.plan import build_plan
from archlab.lab.report import FIGURES, collect, print_report, write_report
from archlab.lab.display import RUNS_DIR
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, ResultStore
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import SUITE_YAML, FakeTrainer, fake_costs, write_suite

PNG = b"\x89PNG\r\n\x1a\n"
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished fake suite whose run directories are deleted: only the database remains."""
    tmp = tmp_path_factory.mktemp("report")
    text = SUITE_YAML.replace("variants: [0, 1]}", "variants: [0, 1, 2]}")  # Welch needs df
    plan = build_plan(load_suite(write_suite(tmp, text)), tmp / "out", costs_fn=fake_costs)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(),
                  console=Console(file=open(os.devnull, "w")))
    shutil.rmtree(plan.out_dir / RUNS_DIR)
    return plan.out_dir


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[str] = []
        self.external: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src") or "")
        for key in ("src", "href"):
            v = a.get(key) or ""
            if v and not v.startswith("data:"):
                self.external.append(v)
        if tag in ("script", "link", "iframe"):
            self.external.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_statistics_from_the_database(suite_dir: Path) -> None:
    with ResultStore(suite_dir / DB_NAME, create=False) as store:
        data = collect(store)
    by = {s.label: s for s in data.summaries}
    assert [s.label for s in data.summaries] == ["llama", "lower-init", "same"]
    assert len(by["llama"].losses) == 3 and data.floor is not None and data.n_tests == 2
    assert by["lower-init"].comparison.verdict == "better"  # init_std 0.01 lowers the fake loss by 0.1
    # Variants have the baseline's seeds (one data order): complete pairs, so the paired test
    # decides; Welch's is reported next to it.
    assert by["lower-init"].comparison.method == "paired"
    assert by["lower-init"].comparison.unpaired.method == "welch"
    assert by["same"].comparison.verdict == "no significant difference"


def test_report_files_and_inline_figures(suite_dir: Path) -> None:
    md, html = write_report(suite_dir)
    text = md.read_text()
    for name, _ in FIGURES:
        assert f"]({name})" in text and (suite_dir / name).read_bytes().startswith(PNG)
    assert "| lower-init |" in text and "better" in text and "Noise floor:" in text

    page = _Page()
    page.feed(html.read_text())
    page.close()
    assert page.external == []  # self-contained: no scripts, styles or images from elsewhere
    assert len(page.imgs) == len(FIGURES)
    for src in page.imgs:
        head, b64 = src.split(",", 1)
        assert head == "data:image/png;base64"
        assert base64.b64decode(b64).startswith(PNG)
    assert page.tags.count("table") == 3 and "better" in "".join(page.text)  # results, costs, compute
    if CHROMIUM.exists():
        _check_in_chromium(html, suite_dir)


def _check_in_chromium(html: Path, tmp: Path) -> None:
    """Render the page headless; a script appended to a copy reports how many images decoded."""
    probe = tmp / "probe.html"
    probe.write_text(html.read_text().replace(
        "</body>", "<script>window.onload=()=>{document.title='decoded:'+"
                   "[...document.images].filter(i=>i.complete&&i.naturalWidth>0).length}</script></body>"))
    dom = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
                          "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert f"<title>decoded:{len(FIGURES)}</title>" in dom


def test_console_table(suite_dir: Path) -> None:
    console = Console(record=True, width=220, file=open(os.devnull, "w"))
    print_report(suite_dir, console)
    shown = console.export_text()
    assert "lower-init" in shown and "better" in shown and "Bonferroni" in shown


def test_report_of_a_suite_in_progress(tmp_path: Path) -> None:
    """Pending variants and a baseline with one seed still give a report (no statistics yet)."""
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "o", costs_fn=fake_costs)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs[:2]), train_fn=FakeTrainer(),
                  console=Console(file=open(os.devnull, "w")))
    md, html = write_report(plan.out_dir)
    text = md.read_text()
    assert "| same | 0/2 |" in text and "pending" in text and "not available" in text
    assert html.read_text().count("data:image/png;base64,") == len(FIGURES)


def test_counts_read_in_the_singular_and_devices_say_what_they_are(tmp_path: Path) -> None:
    """One seed, one thread, one run read as such (no "1 seeds"), and the device line names each
    distinct device with the runs it trained."""
    from dataclasses import replace

    from archlab.lab.fmt import plural
    from archlab.lab.report import COSTS_NOTE, costs_table, device_text, devices_fact, fig_curves

    assert (plural(1, "seed"), plural(2, "seed"), plural(0, "run")) == ("1 seed", "2 seeds", "0 runs")
    assert plural(2, "process", "processes") == "2 processes"
    assert device_text("cpu (x86_64, 1 threads)") == "cpu (x86_64), 1 thread per run"
    assert device_text("cpu (aarch64, 16 threads)") == "cpu (aarch64), 16 threads per run"
    assert device_text("NVIDIA H200") == "NVIDIA H200"

    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "o", costs_fn=fake_costs)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs[:3]), train_fn=FakeTrainer(),
                  console=Console(file=open(os.devnull, "w")))
        data = collect(store)
    rows = [replace(r, device=d) for r, d in zip(data.rows, ["cpu (x86_64, 1 threads)", "cpu (x86_64, 2 threads)",
                                                           "cpu (x86_64, 2 threads)"])]
    assert devices_fact(rows) == ("Devices: cpu (x86_64), 1 thread per run (1 run); "
                                  "cpu (x86_64), 2 threads per run (2 runs)")
    assert devices_fact(rows[1:]) == "Device: cpu (x86_64), 2 threads per run (2 runs)"

    legend = [t.get_text() for t in fig_curves(data).axes[1].get_legend().get_texts()]
    assert legend == ["llama (1 seed)", "lower-init (1 seed)", "same (1 seed)"]
    header, table = costs_table(data)
    at_once = header.index("runs at once")
    assert "train tokens/s (see note)" in header and [r[at_once] for r in table] == ["1", "1", "1"]

    md = write_report(plan.out_dir)[0].read_text()
    assert COSTS_NOTE in md and "not comparable" in COSTS_NOTE
    assert "Device: fake-cpu (3 runs)" in md and "Final loss = the final weights on a fixed validation sample of 1,048,576 tokens" in md
    assert "in a variant's difference from the baseline on the same sample (what a paired verdict rests on)" in md and "over 2 variants" in md
    for wrong in ("1 seeds", "1 threads", "1 runs", "variant(s)"):
        assert wrong not in md
