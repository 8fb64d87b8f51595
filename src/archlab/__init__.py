"""archlab: train, serve and compare decoder-only Transformer variants under matched budgets."""

__version__ = "0.1.0"
