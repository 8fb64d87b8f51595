"""The plain-PyTorch anchor's 124M (or 350M) training row alone, with the card's ceilings.

    python3 benchmarks/anchor_train124.py PATH/TO/gpu_anchor.py [124M|350M]

``gpu_anchor.py`` (the workplace's shared reference, ``shared/tools``) also trains its 350M model
and measures decode at two sizes, which a call that needs only the 124m ratio (issue 30's
baseline >= 1.25x the anchor) cannot afford beside its own rows. This runs that script's own
``train_tput`` at its 124M configuration (32 x 1024 tokens, vocabulary 50,304), or at its 350M one
(16 x 1024) for a 350m table, so the figure is the reference's and nothing of it is
re-implemented here. Prints one JSON object per line.
"""

import importlib.util
import json
import sys

import torch

# gpu_anchor.py's own training configurations: (vocabulary, width, heads, layers, batch, length).
SIZES = {"124M": (50304, 768, 12, 12, 32, 1024), "350M": (50304, 1024, 16, 24, 16, 1024)}


def main() -> None:
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] not in SIZES):
        print(f"usage: anchor_train124.py PATH/TO/gpu_anchor.py [{'|'.join(SIZES)}]", file=sys.stderr)
        sys.exit(2)
    size = sys.argv[2] if len(sys.argv) == 3 else "124M"
    if not torch.cuda.is_available():
        raise SystemExit("anchor_train124: no CUDA device; nothing to measure")
    spec = importlib.util.spec_from_file_location("gpu_anchor", sys.argv[1])
    if spec is None or spec.loader is None:
        raise SystemExit(f"anchor_train124: cannot load {sys.argv[1]}")
    anchor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(anchor)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the anchor's own main does
    print(json.dumps(anchor.env()), flush=True)
    print(json.dumps(anchor.ceilings()), flush=True)
    print(f"gpt{size}", json.dumps(anchor.train_tput(*SIZES[size])), flush=True)


if __name__ == "__main__":
    main()
