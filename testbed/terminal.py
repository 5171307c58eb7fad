"""Text from ranks and hosts made inert before it reaches a terminal or Rich.

A rank or a host can print escape sequences (retitle the terminal, move the cursor, hide
text, OSC 52 to the clipboard) and Rich markup (`[/tmp]` is a closing tag to Rich). inert()
replaces every control character but tab and newline with a visible \\xNN (a carriage return,
which overwrites a line, included); plain() also escapes Rich's markup, for text that goes
through a Rich console.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(text: str) -> str:
    """text with every control character (ESC, CR, BEL, C1 ...) but tab and newline shown as \\xNN."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def plain(text: str) -> str:
    """inert(text), with Rich's markup escaped: shown as written, never interpreted."""
    from rich.markup import escape

    return escape(inert(text))
