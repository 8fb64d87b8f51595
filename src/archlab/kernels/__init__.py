"""Custom kernels. ``archlab.kernels.routing.route`` is the depth-routing (AttnRes/MHAR) entry.

Importing this package does not import Triton: the Triton kernels are loaded on first use, and
Triton decides between compiling and interpreting them (``TRITON_INTERPRET``) at that import.
"""
