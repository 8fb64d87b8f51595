"""``archlab generate``: ``--compile`` changes speed, never tokens; the report tells start-up from
decoding."""

from __future__ import annotations

import re

import pytest

from archlab.infer.cli import AUTO_COMPILE_MIN_STEPS, GenerationClock, use_compile
from tests.helpers import run_cli


@pytest.mark.parametrize("choice,device,steps,want", [
    ("on", "cpu", 8, True), ("off", "cuda", 4096, False),
    ("auto", "cuda", AUTO_COMPILE_MIN_STEPS, True), ("auto", "cuda", AUTO_COMPILE_MIN_STEPS - 1, False),
    ("auto", "cpu", 4096, False),
])
def test_auto_compiles_long_generations_on_cuda_only(choice, device, steps, want):
    assert use_compile(choice, device, steps) is want


def test_compile_on_and_off_give_the_same_greedy_tokens(tiny_run, capsys):
    outs = {}
    for choice in ("off", "on"):
        code, out, err = run_cli(capsys, "generate", "--ckpt", str(tiny_run), "--prompt", "def parse(",
                                 "--prompt", "import", "--max-new-tokens", "24", "--temperature", "0",
                                 "--device", "cpu", "--compile", choice)
        assert code == 0, err
        outs[choice] = out
        how = "decode step compiled" if choice == "on" else "eager"
        assert re.search(rf"\d+ tokens in [\d.]+ s after loading in [\d.]+ s \({how}\): first token after", err), err
        assert re.search(r"then \d+ tokens at [\d,.]+ tokens/s over 2 sequence\(s\), timed after the first decode "
                         r"hand-over", err), err
    assert outs["on"] == outs["off"] and len(outs["off"].splitlines()) >= 3


def test_the_rate_leaves_out_the_first_hand_overs():
    """Tokens arriving at 0 (the prefill's), 5 (the first decode step, compiled on first use) and
    then 20 per second: the rate is 20 tokens/s, not the 6 that counting from the first token would
    give."""
    clock = GenerationClock()
    clock.deliveries = [(0.0, 2), (5.0, 4), (6.0, 24), (7.0, 44)]

    class Done:
        tokens = [0] * 22
        first_token_at = 0.0

    line = clock.report(1.5, 0.0, 7.0, [Done(), Done()], 10, compiled=True, captured=True)
    assert "first token after 0 ms (an eager prefill of 10 prompt tokens)" in line
    assert "then 40 tokens at 20.0 tokens/s over 2 sequence(s)" in line
    assert "(5.00 s, compiling and capturing the step on first use)" in line
    clock.deliveries = [(0.0, 1), (0.5, 2)]
    assert "too few tokens" in clock.report(0.1, 0.0, 0.5, [Done()], 3, compiled=False, captured=False)
