"""TokenData: stateless deterministic train batches, fixed val batches, vocab and size checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from archlab.data import TokenData
from archlab.errors import DataError
from tests.data.data_testutil import split_tokens


def _shard_of(window: np.ndarray, shards: list[bytes]) -> int:
    """Index of the shard that holds ``window`` as a contiguous, token-aligned run."""
    needle = window.astype(np.uint16).tobytes()
    for i, data in enumerate(shards):
        at = data.find(needle)
        while at != -1 and at % 2:
            at = data.find(needle, at + 1)
        if at != -1:
            return i
    raise AssertionError("window not found in any shard")


def test_properties(stdlib_dir: Path) -> None:
    data = TokenData(stdlib_dir)
    manifest = json.loads((stdlib_dir / "manifest.json").read_text())
    assert data.manifest == manifest and data.vocab_size == 512
    assert data.tokenizer.get_vocab_size() == 512
    assert data.tokenizer_path == stdlib_dir / "tokenizer.json"
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        assert data.n_tokens(split) == entry["n_tokens"]
        assert data.bytes_per_token(split) == pytest.approx(entry["n_bytes"] / entry["n_tokens"])
        assert 1.5 < data.bytes_per_token(split) < 4.0  # byte-level BPE with 512 tokens on code


def test_train_batch_is_a_function_of_seed_step_micro(stdlib_dir: Path) -> None:
    a, b = TokenData(stdlib_dir), TokenData(stdlib_dir)
    x, y = a.train_batch(step=7, micro=1, batch_size=8, seq_len=64, seed=3)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 64)
    x2, y2 = b.train_batch(step=7, micro=1, batch_size=8, seq_len=64, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    a.train_batch(step=8, micro=0, batch_size=8, seq_len=64, seed=3)  # other calls change nothing
    assert torch.equal(a.train_batch(7, 1, 8, 64, 3)[0], x)
    for step, micro, seed in ((8, 1, 3), (7, 0, 3), (7, 1, 4)):
        assert not torch.equal(a.train_batch(step, micro, 8, 64, seed)[0], x)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < 512


def test_train_windows_come_from_the_shards_in_proportion_to_size(stdlib_dir: Path) -> None:
    data = TokenData(stdlib_dir)
    shards = [(stdlib_dir / s["file"]).read_bytes() for s in data.manifest["splits"]["train"]["shards"]]
    sizes = np.array([len(s) // 2 for s in shards])
    seq_len = 32
    counts = np.zeros(len(shards))
    for step in range(150):
        x, y = data.train_batch(step, 0, 16, seq_len, seed=0)
        windows = torch.cat([x, y[:, -1:]], dim=1).numpy()
        for window in windows:
            counts[_shard_of(window, shards)] += 1
    expected = (sizes - seq_len) / (sizes - seq_len).sum()
    assert sizes[-1] < sizes[0] / 2  # the last shard is short, so proportions are tested
    # 2400 draws: the standard error of each share is under 0.009
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.02)
    assert abs(counts[-1] / counts.sum() - expected[-1]) < 0.01


def test_val_batches_are_fixed_contiguous_windows(stdlib_dir: Path) -> None:
    data = TokenData(stdlib_dir)
    stream = split_tokens(stdlib_dir, "val").astype(np.int64)
    batches = data.val_batches(n_batches=3, batch_size=4, seq_len=50)
    assert len(batches) == 3
    xs = torch.cat([x.reshape(-1) for x, _ in batches]).numpy()
    ys = torch.cat([y.reshape(-1) for _, y in batches]).numpy()
    np.testing.assert_array_equal(xs, stream[:600])
    np.testing.assert_array_equal(ys, stream[1:601])
    again = TokenData(stdlib_dir).val_batches(3, 4, 50)
    for (x1, y1), (x2, y2) in zip(batches, again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_val_batches_stop_at_the_end_of_the_split(stdlib_dir: Path) -> None:
    """More windows than the split holds: every token is scored once, none wrapped around."""
    data = TokenData(stdlib_dir)
    stream = split_tokens(stdlib_dir, "val").astype(np.int64)
    n = len(stream)
    seq_len = 1000
    fit = (n - 1) // seq_len
    batches = data.val_batches(fit + 3, 2, seq_len)  # asks for about twice the split
    assert data.val_windows(fit + 3, 2, seq_len) == fit
    assert len(batches) == (fit + 1) // 2 and batches[-1][0].shape[0] == 2 - fit % 2
    ys = torch.cat([y.reshape(-1) for _, y in batches]).numpy()
    assert len(ys) == fit * seq_len <= n - 1
    np.testing.assert_array_equal(ys, stream[1:fit * seq_len + 1])  # in order, none repeated
    assert data.target_bytes(torch.cat([y for _, y in batches])) == int(data.token_bytes[stream[1:len(ys) + 1]].sum())


def test_target_bytes_are_the_bytes_of_those_tokens(stdlib_dir: Path) -> None:
    """The per-token byte table adds up to the UTF-8 length of the text the tokens decode to,
    for a prefix of the split as for the whole split (which the manifest records)."""
    data = TokenData(stdlib_dir)
    stream = split_tokens(stdlib_dir, "val").astype(np.int64)
    assert int(data.token_bytes[stream].sum()) == data.manifest["splits"]["val"]["n_bytes"]
    for cut in (1, 777, 5000):
        prefix = stream[:cut]
        text = data.tokenizer.decode(prefix.tolist(), skip_special_tokens=True)
        if "\ufffd" not in text:  # a cut inside a multi-byte character decodes to U+FFFD
            assert data.target_bytes(prefix) == len(text.encode("utf-8"))
    # the whole-split average is not the bytes of a prefix: the old denominator was off
    prefix = stream[:2000]
    assert data.target_bytes(prefix) != round(len(prefix) * data.bytes_per_token("val"))


def test_check_model_vocab(stdlib_dir: Path) -> None:
    data = TokenData(stdlib_dir)
    data.check_model_vocab(512)
    data.check_model_vocab(4096)
    with pytest.raises(DataError, match=r"uses 512 token ids but the model has model.vocab_size=500; "
                                        r"set model.vocab_size to at least 512"):
        data.check_model_vocab(500)


def test_windows_longer_than_a_split_are_refused(stdlib_dir: Path) -> None:
    data = TokenData(stdlib_dir)
    val_tokens = data.n_tokens("val")
    with pytest.raises(DataError, match=rf"val split of .* has {val_tokens} tokens"):
        data.val_batches(1, 1, val_tokens)
    with pytest.raises(DataError, match=r"train split of .*windows of train.seq_len\+1=25001"):
        data.train_batch(0, 0, 1, 25_000, seed=0)  # longer than every 25k-token shard
    with pytest.raises(DataError, match="the data seed must be >= 0"):
        data.train_batch(0, 0, 1, 16, seed=-1)
