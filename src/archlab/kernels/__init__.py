"""Custom kernels. ``archlab.kernels.routing.route`` is the depth-routing (AttnRes/MHAR) entry;
``archlab.kernels.decode_attention`` the attention of a decode step over the static KV cache.

Importing this package does not import Triton: the Triton kernels are loaded on first use, and
Triton decides between compiling and interpreting them (``TRITON_INTERPRET``) at that import.
"""

import os


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (Triton's own spellings)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
