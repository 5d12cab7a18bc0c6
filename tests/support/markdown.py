"""What a reader sees of a Streamlit markdown string."""

from __future__ import annotations

import html
import re

from markdown_it import MarkdownIt

_RENDER = MarkdownIt().render


def shown(markdown: str) -> str:
    """The text a reader sees of an element's markdown: rendered by a CommonMark parser
    (markdown-it; Streamlit's react-markdown parses the same way), tags dropped, entities
    decoded. Tests read this, not the source, where names and paths are escaped."""
    return html.unescape(re.sub(r"<[^>]+>", "", _RENDER(markdown))).strip()
