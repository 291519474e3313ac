"""MkDocs hooks: the README as the site's home page, and links to files outside docs/.

The guides are read on the site and in the repository, so they link to examples/, bench/ and
CONTRIBUTING.md by relative paths that work in a checkout. Those files are not part of the site: here
such a link becomes a link to the repository (``repo_url`` in mkdocs.yml, from ``$AGL_REPO_URL``), or
its plain text when no repository URL is set. A link to a file that does not exist fails the build,
as mkdocs' own ``--strict`` does for links inside docs/.
"""

from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = "<!-- docs-site: include README.md -->"
# [text](target) and ![alt](target), not inside inline code; targets without spaces
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)", re.M)


def on_startup(command: str, dirty: bool) -> None:  # noqa: ARG001 - mkdocs' hook signature
    """Run as ``mkdocs build``, the venv's ``bin/`` is first on ``sys.path`` and holds the ``agl``
    console script: mkdocstrings (griffe) would take that file for the ``agl`` package and find none of
    its modules. Drop such entries so the installed package is what gets documented (at startup: after
    mkdocs restored ``sys.path`` from loading this module, before mkdocstrings reads it)."""
    sys.path[:] = [p for p in sys.path if not (Path(p or ".") / "agl").is_file()]


def _rewrite(markdown: str, source: str, page_dir: str, repo_url: str) -> str:
    """Rewrite the relative links of ``markdown`` (written at repo path ``source``) for a page in
    the site directory ``page_dir`` (relative to docs/)."""

    def one(m: re.Match[str]) -> str:
        bang, text, target = m.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        if repo_path.startswith("..") or not (ROOT / repo_path).exists():
            raise PluginError(f"{source}: the link to {target!r} names no file of the repository")
        if repo_path.startswith("docs/"):
            rel = posixpath.relpath(repo_path[len("docs/") :], page_dir or ".")
            return f"{bang}[{text}]({rel}{'#' + anchor if anchor else ''})"
        if not repo_url:
            return text if not bang else f"`{repo_path}`"
        kind = "raw" if bang else "blob"
        return (
            f"{bang}[{text}]({repo_url.rstrip('/')}/{kind}/main/{repo_path}{'#' + anchor if anchor else ''})"
        )

    parts = FENCE.split(markdown)
    out, in_fence = [], False
    for part in parts:
        if FENCE.fullmatch(part):
            in_fence = not in_fence
            out.append(part)
        elif in_fence:
            out.append(part)
        else:
            out.append(LINK.sub(one, part))
    return "".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - mkdocs' hook signature
    src = page.file.src_uri
    repo_url = config.get("repo_url") or ""
    if INCLUDE in markdown:
        readme = (ROOT / "README.md").read_text(encoding="utf-8")
        readme = _rewrite(readme, "README.md", posixpath.dirname(src), repo_url)
        return markdown.replace(INCLUDE, readme)
    return _rewrite(markdown, "docs/" + src, posixpath.dirname(src), repo_url)
