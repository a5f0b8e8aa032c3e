"""Fill a deploy/ template: `python deploy/render.py TEMPLATE NAME=value ... > OUT`.

Placeholders are `{{NAME}}` (required) or `{{NAME|default}}`. A required one left without a
value is an error that names it; values given but unused are reported, so a typo shows.
Standard library only: it runs wherever the job is submitted from.
"""
from __future__ import annotations

import re
import sys

PLACEHOLDER = re.compile(r"\{\{\s*([A-Z][A-Z0-9_]*)\s*(?:\|([^}]*))?\}\}")


def placeholders(text: str) -> dict[str, str | None]:
    """{NAME: default or None (required)} for every placeholder in `text`."""
    out: dict[str, str | None] = {}
    for m in PLACEHOLDER.finditer(text):
        if out.get(m[1]) is None:
            out[m[1]] = m[2]
    return out


def render(text: str, values: dict[str, str]) -> str:
    missing = sorted(k for k, d in placeholders(text).items() if d is None and k not in values)
    if missing:
        raise KeyError(f"the template needs {', '.join(missing)} (give NAME=value for each)")

    def fill(m: re.Match) -> str:
        return str(values[m[1]]) if m[1] in values else m[2]

    return PLACEHOLDER.sub(fill, text)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    path, pairs = argv[0], argv[1:]
    values = {}
    for p in pairs:
        if "=" not in p:
            print(f"render: {p!r} must be NAME=value", file=sys.stderr)
            return 2
        k, v = p.split("=", 1)
        values[k] = v
    text = open(path).read()
    unknown = sorted(set(values) - set(placeholders(text)))
    if unknown:
        print(f"render: {path} has no placeholder {', '.join(unknown)}; it has: "
              f"{', '.join(sorted(placeholders(text)))}", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(render(text, values))
    except KeyError as e:
        print(f"render: {path}: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
