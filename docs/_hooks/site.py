"""MkDocs hooks for the rpcdist site.

* Pages under docs/ missing from ``nav`` are listed under "More", so a page
  added by someone who did not edit mkdocs.yml is still reachable from the
  navigation instead of built but linked from nowhere.
* Docstrings use Sphinx roles in places (``:class:`Future```); in the API
  reference these render as ``:class:`` before the name, which the site
  drops (the name stays, in code style). Likewise a paragraph ending in
  ``::`` (reST's "a literal block follows") ends in one colon.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.nav")


def _listed(nav: Any) -> set[str]:
    found: set[str] = set()
    items = nav if isinstance(nav, list) else [nav]
    for item in items:
        if isinstance(item, str):
            found.add(item)
        elif isinstance(item, dict):
            for value in item.values():
                found |= _listed(value)
    return found


def on_config(config: Any) -> Any:
    nav = config.get("nav")
    if not nav:
        return config
    docs = Path(config["docs_dir"])
    pages = sorted(
        str(p.relative_to(docs)).replace("\\", "/")
        for p in docs.rglob("*.md")
        if not any(part.startswith("_") for part in p.relative_to(docs).parts)
    )
    missing = [p for p in pages if p not in _listed(nav)]
    if missing:
        log.info("pages not in mkdocs.yml's nav, listed under 'More': %s", ", ".join(missing))
        nav.append({"More": missing})
    return config


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):(<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(r"\1", html).replace("::</p>", ":</p>")
