"""Analysis of trained models: routing diagnostics (``probe``), the loss at every early exit
(``exits``), entity-familiarity probes of the MLP activations (``familiarity``) and their CLI
(``cli``).

``probe`` and ``exits`` import torch; they are imported on use so that the command line's parser
does not.
"""

from __future__ import annotations

__all__ = ["collect_routing", "probe_checkpoint", "probe_routing", "summarize"]


def __getattr__(name: str):
    if name in __all__:
        from archlab.analysis import probe

        return getattr(probe, name)
    raise AttributeError(name)
