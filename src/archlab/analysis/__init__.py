"""Analysis of trained models: routing diagnostics (``probe``) and their CLI (``cli``)."""

from archlab.analysis.probe import collect_routing, probe_checkpoint, probe_routing, summarize

__all__ = ["collect_routing", "probe_checkpoint", "probe_routing", "summarize"]
