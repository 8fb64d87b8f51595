"""The entity set: known, obscure-but-real and fabricated names per domain, each in a one-sentence
question, balanced and fixed by a seed (``archlab probe entities``).

Real names come from data that installed packages ship, and "known" against "obscure" is decided
by a rule on that data rather than by hand:

* ``city``: time-zone cities of the tz database's ``zone.tab`` (from the ``tzdata`` package, else
  ``pytz``, else the system's copy). Known: the
  city of a European or Asian country that has one zone (its capital or main city: Paris, Tokyo).
  Obscure: a country's secondary zones in the sub-regional groups (``America/Indiana/...``,
  ``America/Argentina/...``) and in Antarctica, Greenland, Indonesia, Kazakhstan and Mongolia, less
  each group's first zone, which ``zone.tab`` lists first because it is the most populous (so
  Indianapolis and Cordoba are left out, Tell City and Rio Gallegos kept).
* ``module``: Python's standard-library modules (``sys.stdlib_module_names``, public names only),
  ranked by how many of the interpreter's own stdlib source files (its test suite left out) import
  them. Known: the 60 most imported (os, re); obscure: those no other stdlib file imports (nis,
  xdrlib). Being imported inside the stdlib is only a proxy for use: a few leaf modules users do
  know (timeit, uuid) land among the obscure ones.

Fabricated names are sampled from a character-level trigram model trained on every real name of
the domain. A sample is rejected when it equals (ignoring case) a real name of the domain or
another sample, when it is a word of the stdlib sources' vocabulary (so "trick" or "grand" cannot
pass as invented), or when it is shorter than 4 characters (short strings are mostly real words or
abbreviations) or longer than any real name. A fabricated name may still happen to
be real somewhere outside the source list; the set cannot rule that out.

The same seed gives the same file on the same Python and tz database versions; the results ship
the file they used.
"""

from __future__ import annotations

import functools
import json
import random
import re
import sys
import sysconfig
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from archlab.errors import UsageError

KINDS = ("known", "obscure", "fabricated")
DOMAINS = ("city", "module")
FORMAT_VERSION = 1

TEMPLATES = {
    "city": ("What is the population of {name}?", "Which country is the city of {name} in?",
             "What is the weather usually like in {name}?", "What is {name} best known for?"),
    "module": ("What does the Python module {name} do?", "How do I use the {name} module in Python?",
               "Which functions does Python's {name} module provide?",
               "When was the {name} module added to Python?"),
}

# Regions whose single-zone countries name their capital or main city in the zone (Europe/Paris);
# America's single-zone entries are mostly small islands, Africa's less often known to a small model.
_KNOWN_CITY_REGIONS = ("Europe", "Asia")
# Countries whose secondary zones are all small or remote places (research stations, district towns).
_OBSCURE_CITY_COUNTRIES = ("AQ", "GL", "ID", "KZ", "MN")


def _city_name(zone: str) -> str:
    return zone.rsplit("/", 1)[-1].replace("_", " ")


def zone_tab() -> tuple[str, str]:
    """The text of the tz database's ``zone.tab`` and where it came from: the ``tzdata`` package,
    else ``pytz``'s copy, else the system's time-zone directories (``zoneinfo.TZPATH``)."""
    import importlib.resources
    import importlib.util
    import zoneinfo

    candidates = []
    for package in ("tzdata", "pytz"):
        if importlib.util.find_spec(package) is not None:
            candidates.append((package, importlib.resources.files(package).joinpath("zoneinfo", "zone.tab")))
    candidates += [(root, Path(root) / "zone.tab") for root in zoneinfo.TZPATH]
    for where, path in candidates:
        if path.is_file():
            return path.read_text(encoding="utf-8"), where
    raise UsageError("the city domain needs the tz database's zone.tab: pip install tzdata")


def city_names() -> dict[str, list[str]]:
    """``{"known": [...], "obscure": [...], "all": [...]}`` city names from ``zone.tab``, whose rows
    list each country's zones in file order."""
    text, _ = zone_tab()
    by_country: dict[str, list[str]] = defaultdict(list)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            fields = line.split("\t")
            by_country[fields[0]].append(fields[2])
    known, obscure = set(), set()
    for country, zones in sorted(by_country.items()):
        if len(zones) == 1 and zones[0].split("/")[0] in _KNOWN_CITY_REGIONS:
            known.add(_city_name(zones[0]))
            continue
        group_firsts = set()
        for zone in zones[1:]:
            parts = zone.split("/")
            if len(parts) >= 3:
                group = "/".join(parts[:-1])
                if group not in group_firsts:  # the group's most populous zone is listed first
                    group_firsts.add(group)
                    continue
                obscure.add(_city_name(zone))
            elif country in _OBSCURE_CITY_COUNTRIES:
                obscure.add(_city_name(zone))
    every = {_city_name(z) for zones in by_country.values() for z in zones}
    return {"known": sorted(known), "obscure": sorted(obscure - known), "all": sorted(every)}


_IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
_WORD = re.compile(r"[A-Za-z]+")


@functools.lru_cache(maxsize=1)
def _stdlib_scan() -> tuple[Counter[str], frozenset[str]]:
    """Over the interpreter's stdlib sources (its test suite left out, since it imports nearly every
    module once on purpose): how many files import each top-level module, and every word that
    occurs (lower case), a large English and programming vocabulary."""
    counts: Counter[str] = Counter()
    words: set[str] = set()
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or {"test", "tests", "idle_test"} & set(path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        counts.update(set(_IMPORT.findall(text)))  # a file counts once per module it imports
        words.update(w.lower() for w in _WORD.findall(text))
    return counts, frozenset(words)


def module_names() -> dict[str, list[str]]:
    """Public stdlib module names split by how many stdlib source files import them."""
    public = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m != "this")
    counts, _ = _stdlib_scan()
    ranked = sorted(public, key=lambda m: (-counts[m], m))
    obscure = sorted(m for m in public if counts[m] == 0)
    return {"known": sorted(ranked[:60]), "obscure": obscure, "all": public}


def source_names(domain: str) -> dict[str, list[str]]:
    return city_names() if domain == "city" else module_names()


class CharTrigrams:
    """A character trigram model of names: the next character's counts given the two before it,
    with ``^`` padding the start and ``$`` ending a name. Sampling only follows transitions seen in
    the real names, so samples keep their spelling habits (capitals, spaces, underscores)."""

    def __init__(self, names: list[str]):
        self.next: dict[str, Counter[str]] = defaultdict(Counter)
        for name in names:
            padded = "^^" + name + "$"
            for i in range(len(padded) - 2):
                self.next[padded[i:i + 2]][padded[i + 2]] += 1

    def sample(self, rng: random.Random, max_len: int) -> str:
        context, out = "^^", []
        while len(out) <= max_len:
            counts = self.next[context]
            chars = sorted(counts)
            ch = rng.choices(chars, weights=[counts[c] for c in chars])[0]
            if ch == "$":
                break
            out.append(ch)
            context = context[1] + ch
        return "".join(out)


MIN_FABRICATED_LEN = 4


def fabricate(real: list[str], count: int, rng: random.Random, max_tries: int = 100_000) -> list[str]:
    """``count`` distinct trigram samples that are no real name or vocabulary word (ignoring case),
    4 characters or more and no longer than the longest real name."""
    model = CharTrigrams(real)
    taken = {r.lower() for r in real} | _stdlib_scan()[1]
    low, high = MIN_FABRICATED_LEN, max(len(r) for r in real)
    out: list[str] = []
    for _ in range(max_tries):
        name = model.sample(rng, high)
        if low <= len(name) <= high and name.strip() == name and name.lower() not in taken:
            taken.add(name.lower())
            out.append(name)
            if len(out) == count:
                return out
    raise UsageError(f"could not fabricate {count} new names in {max_tries} samples; ask for fewer")


def build_entities(seed: int, per_kind: int = 40, domains: tuple[str, ...] = DOMAINS) -> dict[str, Any]:
    """The entity set: per domain ``per_kind`` names of each kind, each in one template drawn with
    the seed. Items are ordered by domain, then kind, then name."""
    rng = random.Random(seed)
    items = []
    sources = {}
    for domain in domains:
        names = source_names(domain)
        for kind in ("known", "obscure"):
            if len(names[kind]) < per_kind:
                raise UsageError(f"--per-kind {per_kind} is more than the {len(names[kind])} {kind} "
                                 f"{domain} names the sources give")
        chosen = {kind: sorted(rng.sample(names[kind], per_kind)) for kind in ("known", "obscure")}
        chosen["fabricated"] = sorted(fabricate(names["all"], per_kind, rng))
        sources[domain] = {kind: len(names[kind]) for kind in ("known", "obscure", "all")}
        for kind in KINDS:
            for name in chosen[kind]:
                template = rng.choice(TEMPLATES[domain])
                items.append({"domain": domain, "kind": kind, "name": name, "prompt": template.format(name=name)})
    return {"format": FORMAT_VERSION, "seed": seed, "per_kind": per_kind, "python": sys.version.split()[0],
            "zone_tab": zone_tab()[1] if "city" in domains else None, "source_sizes": sources, "items": items}


def write_entities(path: str | Path, seed: int, per_kind: int = 40) -> dict[str, Any]:
    data = build_entities(seed, per_kind)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return data


def read_entities(path: str | Path) -> list[dict[str, str]]:
    """The items of an entity file, checked: each has a domain, a known kind, a name found inside
    its prompt."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        items = data["items"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--entities {p}: not an entity file ({e.__class__.__name__}: {e})") from None
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("kind") not in KINDS or not item.get("domain") \
                or not item.get("name") or item["name"] not in str(item.get("prompt", "")):
            raise UsageError(f"--entities {p}: item {i} needs a domain, a kind in {KINDS} and a name inside its prompt")
    return items
