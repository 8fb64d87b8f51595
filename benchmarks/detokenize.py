"""The server's incremental detokenisation (``archlab.infer.server.TextStream``) against decoding
the whole sequence at every token (its former method, ``tests/infer/test_text_stream.WholeText``):
host time per token, and per decode step of 64 streams, at several stream lengths.

    python benchmarks/detokenize.py --tokenizer DATA_DIR/tokenizer.json

Every streamed token is detokenised on the server's event loop, in the one process that serves
every stream, so this time adds to every decode step under load. CPU only; prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tokenizers import Tokenizer  # noqa: E402

from archlab.infer.server import TextStream  # noqa: E402
from tests.infer.test_text_stream import WholeText  # noqa: E402


def per_token_s(cls, tok, ids: list[int], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        s = cls(tok, ("\n\n\n\n",), None)
        for i, x in enumerate(ids):
            s.add(x, final=i == len(ids) - 1)
    return (time.perf_counter() - t0) / reps / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json (a prepared data directory's)")
    ap.add_argument("--lengths", default="64,256,1024", help="stream lengths in tokens")
    ap.add_argument("--streams", type=int, default=64, help="streams per decode step, for the per-step column")
    args = ap.parse_args()
    tok = Tokenizer.from_file(args.tokenizer)
    text = "".join(p.read_text() for p in sorted((ROOT / "src" / "archlab" / "infer").glob("*.py")))
    ids = tok.encode(text).ids
    print(f"| tokens per stream | whole text us/token | window us/token | whole text ms/step ({args.streams} "
          f"streams) | window ms/step |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        reps = max(2, 20_000 // n)
        whole, window = (per_token_s(c, tok, ids[:n], reps) for c in (WholeText, TextStream))
        print(f"| {n} | {whole * 1e6:.1f} | {window * 1e6:.1f} | {whole * args.streams * 1e3:.2f} | "
              f"{window * args.streams * 1e3:.2f} |")


if __name__ == "__main__":
    main()
