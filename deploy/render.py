"""Fill a deploy/ template: `python deploy/render.py TEMPLATE NAME=value ... > OUT`.

Placeholders are `{{NAME}}` (required), `{{NAME|default}}`, or `{{NAME?}}` (optional: the whole
line is left out when no value is given). A required one left without a value is an error that
names it; values given but unused are reported, so a typo shows.

Values are quoted so that no value can change the file's structure, by the template's language,
named on its `# render:` line (else taken from the extension: .yaml/.yml, .sh/.sbatch):
- yaml: a value is one double-quoted scalar (JSON string syntax, which YAML reads); inside a
  "..." of the template it is escaped into that string.
- shell: a value is one shlex-quoted word; `words=` names the ones split into several words.
- `int=A,B`: whole numbers (replicas, GPUs, ports, seconds), checked and written bare.
- a value on a comment line (`#SBATCH --job-name=...`, read by sbatch, not by the shell) may
  hold only letters, digits and `_.,:@%/+=-`: a newline or a space there could start a command.
- `check=A<=B`: a relation between two int values (a save allowance within a notice period).
Standard library only: it runs wherever the job is submitted from.
"""
from __future__ import annotations

import re
import shlex
import sys

PLACEHOLDER = re.compile(r"\{\{\s*([A-Z][A-Z0-9_]*)\s*(?:(\?)|\|([^}]*))?\}\}")
HEADER = re.compile(r"^#\s*render:(.*)$", re.M)
COMMENT_SAFE = re.compile(r"[A-Za-z0-9_.,:@%/+=-]+")
OPTIONAL = object()  # placeholders(): the default of a {{NAME?}}
LANGS = {".yaml": "yaml", ".yml": "yaml", ".sh": "shell", ".sbatch": "shell"}


class RenderError(ValueError):
    """A value that cannot go where the template puts it, or a template that cannot be filled."""


def placeholders(text: str) -> dict[str, object]:
    """{NAME: default, None (required) or OPTIONAL} for every placeholder in `text`."""
    out: dict[str, object] = {}
    for m in PLACEHOLDER.finditer(text):
        default = OPTIONAL if m[2] else m[3]
        if out.get(m[1]) is None:
            out[m[1]] = default
    return out


def header(text: str, path: str | None = None) -> dict:
    """The template's `# render: lang=... int=... words=... check=A<=B` settings."""
    opts = dict(kv.split("=", 1) for m in HEADER.finditer(text) for kv in m[1].split() if "=" in kv)
    lang = opts.get("lang") or next((v for ext, v in LANGS.items() if path and path.endswith(ext)), None)
    if lang not in ("yaml", "shell"):
        raise RenderError(f"{path or 'the template'}: say `# render: lang=yaml` or `lang=shell` "
                          f"(or name it .yaml / .sbatch / .sh)")
    split = lambda k: [x for x in opts.get(k, "").split(",") if x]  # noqa: E731
    checks = []
    for c in split("check"):
        a, sep, b = c.partition("<=")
        if not sep:
            raise RenderError(f"render header: check={c!r} must be A<=B")
        checks.append((a, b))
    return {"lang": lang, "ints": set(split("int")), "words": set(split("words")), "checks": checks}


def _yaml_escape(v: str) -> str:
    """`v` as the inside of a YAML double-quoted scalar: JSON's escapes, plus YAML's line breaks
    (NEL, U+2028/2029) and the BOM, which JSON leaves raw."""
    out = []
    for ch in v:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif o < 0x20 or 0x7F <= o <= 0x9F or ch in "\u2028\u2029\ufeff":
            out.append(f"\\u{o:04x}")
        elif 0xD800 <= o <= 0xDFFF:
            raise RenderError("a value holds an unpaired surrogate (not text)")
        else:
            out.append(ch)
    return "".join(out)


def _quotes_before(line: str, col: int, quote: str) -> int:
    """How many unescaped `quote` characters come before `col` on `line`."""
    return len(re.findall(r'(?<!\\)' + re.escape(quote), line[:col]))


def _quote(name: str, value: str, spec: dict, line: str, col: int) -> str:
    if name in spec["ints"]:
        if not re.fullmatch(r"[0-9]+", value.strip()):
            raise RenderError(f"{name}={value!r} must be a whole number (e.g. {name}=8)")
        return str(int(value))
    if line.lstrip().startswith("#"):
        if not COMMENT_SAFE.fullmatch(value):
            raise RenderError(f"{name}={value!r} goes on a comment line ({line.strip()[:40]}...): only "
                              f"letters, digits and _.,:@%/+=- can go there (no spaces, quotes or newlines)")
        return value
    if spec["lang"] == "yaml":
        if _quotes_before(line, col, "'") % 2:
            raise RenderError(f"template: {{{{{name}}}}} is inside '...': use \"...\" or no quotes")
        inside = _quotes_before(line, col, '"') % 2 == 1
        return _yaml_escape(value) if inside else '"' + _yaml_escape(value) + '"'
    if _quotes_before(line, col, '"') % 2 or _quotes_before(line, col, "'") % 2:
        raise RenderError(f"template: {{{{{name}}}}} is inside quotes; render quotes it itself, "
                          f"leave it bare")
    if name in spec["words"]:
        try:
            return " ".join(shlex.quote(w) for w in shlex.split(value))
        except ValueError as e:
            raise RenderError(f"{name}={value!r}: {e} (it is split into words like a shell line)") from None
    return shlex.quote(value)


def render(text: str, values: dict[str, str], path: str | None = None) -> str:
    """`text` with its placeholders filled from `values` (quoted for the template's language)."""
    found = placeholders(text)
    missing = sorted(k for k, d in found.items() if d is None and k not in values)
    if missing:
        raise KeyError(f"the template needs {', '.join(missing)} (give NAME=value for each)")
    spec = header(text, path)
    for a, b in spec["checks"]:
        got = {k: values.get(k, found.get(k)) for k in (a, b)}
        for k, v in got.items():
            if not isinstance(v, str) or not re.fullmatch(r"[0-9]+", v.strip()):
                raise RenderError(f"{k}={v!r} must be a whole number (e.g. {k}=300)")
        if int(got[a]) > int(got[b]):
            raise RenderError(f"{a}={got[a]} must be <= {b}={got[b]}: jaxpar must finish (or give up) "
                              f"its save before the scheduler's notice runs out")
    lines = []
    for line in text.splitlines(keepends=True):
        ms = list(PLACEHOLDER.finditer(line))
        if any(m[2] and m[1] not in values for m in ms):
            continue  # an optional placeholder without a value: the line is left out
        out, pos = [], 0
        for m in ms:
            value = values[m[1]] if m[1] in values else m[3]
            out += [line[pos:m.start()], _quote(m[1], str(value), spec, line, m.start())]
            pos = m.end()
        lines.append("".join(out) + line[pos:])
    return "".join(lines)


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
        sys.stdout.write(render(text, values, path))
    except (KeyError, RenderError) as e:
        print(f"render: {path}: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
