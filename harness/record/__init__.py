"""``kvscope record``: a recording reverse proxy for OpenAI-compatible traffic, and the step that turns its
exchange log into a text-mode trace (:mod:`.proxy`, :mod:`.tokenize`, :mod:`.build`; docs/record.md)."""
