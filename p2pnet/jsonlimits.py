"""Untrusted JSON text, bounded before it is parsed: nesting depth measured without recursion.

Python's `json` parser recurses once per nested array or object, so a few thousand `[` make
it raise RecursionError (or worse, exhaust the C stack). Every parser of untrusted JSON in
this project (the control socket, safetensors headers) first asks `exceeds_depth`, which
walks the text once with a flat loop and says whether any prefix opens more than `limit`
arrays/objects outside strings. For valid JSON that is exactly "nesting deeper than limit";
for invalid JSON it never undercounts what a parser would reach before its first error, so a
text that passes cannot make the parser recurse deeper than `limit`.

This module must not parse values (callers do, with their own hooks) and must not do I/O.
"""

from __future__ import annotations

import re

_SPECIAL = re.compile(r'[\[\]{}"\\]')


def exceeds_depth(text: str, limit: int) -> bool:
    """True when `text` nests arrays/objects more than `limit` deep (strings are skipped)."""
    if text.count("[") + text.count("{") <= limit:
        return False  # cannot open more than it has
    depth = 0
    in_string = False
    skip_to = 0  # the character after a backslash inside a string is escaped, whatever it is
    for match in _SPECIAL.finditer(text):
        at = match.start()
        if at < skip_to:
            continue
        char = text[at]
        if in_string:
            if char == "\\":
                skip_to = at + 2
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth = max(depth - 1, 0)  # a stray closer is a syntax error; never undercount
    return False
