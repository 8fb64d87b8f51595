"""Kernel-test setup: the Triton kernels run on CUDA, or in Triton's CPU interpreter without a GPU.

On a machine with a GPU the kernels are compiled and run natively, on CUDA tensors (the
``kernel_device`` fixture). CI has no GPU, so there the Triton kernels are tested with
``TRITON_INTERPRET=1`` on CPU tensors. With Triton 3.9 the variable must be set before ``triton``
is first imported (``@triton.jit`` and Triton's own helpers read it when they are decorated), and
importing ``torch._dynamo`` imports ``triton``. The root ``tests/conftest.py`` therefore sets it
before anything else is imported, on machines without a GPU.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "compile: runs torch.compile on CPU (about 30 s cold; deselect with "
        "-m 'not compile')")
    config.addinivalue_line(
        "markers", "triton_interpret: runs the Triton kernels (natively on CUDA, else in Triton's "
        "CPU interpreter)")


@pytest.fixture(scope="session")
def triton_interprets() -> bool:
    """Whether Triton was imported in interpreter mode in this process (skips without Triton).

    Checked on the thing that matters: whether Triton's own ``tl.sum`` was decorated for the
    interpreter.
    """
    pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


@pytest.fixture(scope="session")
def routing_triton(triton_interprets: bool) -> ModuleType:
    """``archlab.kernels.routing_triton``: compiled kernels on CUDA, interpreted ones on CPU."""
    if not triton_interprets and not torch.cuda.is_available():
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; "
                           "tests/conftest.py must set it before any import")
    return importlib.import_module("archlab.kernels.routing_triton")


@pytest.fixture(scope="session")
def kernel_device(routing_triton: ModuleType, triton_interprets: bool) -> torch.device:
    """Where the Triton kernels run in this process: ``cuda`` when a GPU is present (compiled
    kernels), else ``cpu`` (the interpreter). Tests draw their inputs on CPU from a seeded
    generator, move them here, and compare on CPU.

    With ``TRITON_INTERPRET=1`` set by hand on a GPU machine the interpreter is in charge, and it
    is a CPU tool: ``cpu`` then too.
    """
    if torch.cuda.is_available() and not triton_interprets:
        return torch.device("cuda")
    return torch.device("cpu")
