"""The command line's bytecode cache: used only where a package has no bytecode of its own, it
makes the second process read what the first compiled; off by switch or a user's own prefix."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

PROBE = """
import sys
from archlab.bytecode import enable_bytecode_cache
print(enable_bytecode_cache("heavypkg"))
import heavypkg
print(heavypkg.__cached__)
"""


def package(root: Path, compiled: bool = False) -> Path:
    pkg = root / "site" / "heavypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 42\n")
    if compiled:
        py_compile.compile(str(pkg / "__init__.py"))  # its own __pycache__, as pip install writes
    return pkg


def probe(root: Path, **env: str) -> list[str]:
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "ARCHLAB_PYCACHE")}
    run_env.update({"PYTHONPATH": os.pathsep.join([SRC, str(root / "site")]), "PYTHONDONTWRITEBYTECODE": "1",
                    "XDG_CACHE_HOME": str(root / "xdg"), **env})
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=run_env, check=True)
    return done.stdout.split()


def test_a_package_without_bytecode_is_compiled_once_into_archlabs_cache(tmp_path):
    pkg = package(tmp_path)
    folder, cached = probe(tmp_path)
    assert folder == str(tmp_path / "xdg" / "archlab" / "pycache")
    assert Path(cached).is_relative_to(folder) and Path(cached).is_file()
    assert not (pkg / "__pycache__").exists()  # nothing written among the installed packages
    written = Path(cached).stat().st_mtime_ns
    assert probe(tmp_path) == [folder, cached]
    assert Path(cached).stat().st_mtime_ns == written  # the second process read it, compiled nothing


def test_a_package_with_its_own_bytecode_is_left_alone(tmp_path):
    package(tmp_path, compiled=True)
    folder, cached = probe(tmp_path)
    assert folder == "None" and "__pycache__" in cached and not (tmp_path / "xdg").exists()


def test_archlab_pycache_names_the_folder(tmp_path):
    package(tmp_path)
    folder, cached = probe(tmp_path, ARCHLAB_PYCACHE=str(tmp_path / "here"))
    assert folder == str(tmp_path / "here") and Path(cached).is_relative_to(folder)


@pytest.mark.parametrize("env", [{"ARCHLAB_PYCACHE": "off"}, {"PYTHONPYCACHEPREFIX": "USER"}])
def test_it_is_off_by_switch_or_under_the_users_own_prefix(tmp_path, env):
    package(tmp_path)
    env = {k: str(tmp_path / "mine") if v == "USER" else v for k, v in env.items()}
    folder, cached = probe(tmp_path, **env)
    assert folder == "None" and not (tmp_path / "xdg").exists()
    if "PYTHONPYCACHEPREFIX" in env:
        assert cached.startswith(str(tmp_path / "mine"))
