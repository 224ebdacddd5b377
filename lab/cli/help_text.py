"""``--help`` as prose the terminal wraps (typer's Rich help, tidied)."""

from __future__ import annotations

import typer


def tidy_help(*apps: typer.Typer) -> None:
    """Make ``--help`` read as prose the terminal wraps.

    typer's Rich help keeps a docstring's single line breaks (the command list and the text after a command's first
    line showed the source's 120-column wrapping as ragged lines at 80 columns): each command's help becomes its
    docstring with the lines of every paragraph joined. And typer 0.2x prints a value type after every option,
    ``<bool>`` after a flag (``--quiet <bool>``, even ``--help <bool>``) as if it took a value, and
    ``<list[str]>`` after a repeatable option: a flag shows none, a repeatable option its element (``<str>``; its
    help says it repeats), a bounded number its type and bounds (``<int> [x>=1]``, not ``<int range> [x>=1]``).
    Only the help's rendering changes, never parsing.
    """
    import inspect
    import re

    for a in apps:
        for info in a.registered_commands:
            text = info.help if info.help is not None else inspect.getdoc(info.callback) or ""
            info.help = "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))
    from typer import core

    for cls in (getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)):
        shown = getattr(cls, "display_type_rich", None)
        if shown is None or getattr(shown, "_servelab_tidy", False):
            continue

        def display_type_rich(self, ctx, _shown=shown):
            if self.metavar is None and getattr(self, "is_flag", False):
                return None
            label = _shown(self, ctx)
            if isinstance(label, str) and self.metavar is None:
                label = re.sub(r"^<list\[(\w+)\]>(\.\.\.)?$", lambda m: f"<{m.group(1).lower()}>{m.group(2) or ''}",
                               label)
                label = re.sub(r"^<(\w+) range>$", r"<\1>", label)  # the range itself follows: <int> [x>=1]
            return label

        display_type_rich._servelab_tidy = True  # type: ignore[attr-defined]
        cls.display_type_rich = display_type_rich
