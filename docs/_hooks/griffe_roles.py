"""A griffe extension: the docstrings as mkdocstrings' Google-style parser reads them.

The docstrings are Google style, with two habits of their own that a reader of the source
or of ``help()`` knows: an ``Example:`` section (griffe's parser reads ``Examples:`` as
code and ``Example:`` as a note of prose, which would show ``>>>`` as quotes), and Sphinx's
cross-reference roles (``:class:`~x.Y```, ``:func:`speedflags.tune```). On the site a role
naming a public name (``speedflags.__all__``, on the API page) becomes a link to its entry;
any other becomes code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|mod|exc|obj):`(~?)([^`]+)`")


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring's roles once its object is loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.public: set[str] = set()

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "speedflags":
            self.public = set(pkg.exports or ())
            for obj in _walk(pkg, set()):
                self._rewrite(obj)

    def _rewrite(self, obj: griffe.Object) -> None:
        if obj.docstring is not None:
            text = EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = ROLE.sub(self._role, text)

    def _role(self, match: re.Match[str]) -> str:
        tilde, target = match.groups()
        shown = target.rsplit(".", 1)[-1] if tilde else target
        name = target.removeprefix("speedflags.")
        if "." not in name and name in self.public:
            return f"[`{shown}`][speedflags.{name}]"
        return f"`{shown}`"


def _walk(obj: griffe.Object, seen: set[str]) -> list[griffe.Object]:
    if obj.path in seen:
        return []
    seen.add(obj.path)
    found = [obj]
    for member in obj.members.values():
        if member.is_alias:
            continue
        found.extend(_walk(member, seen))  # type: ignore[arg-type]
    return found
