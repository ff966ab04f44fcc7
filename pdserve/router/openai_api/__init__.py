"""The router's OpenAI-compatible HTTP API (docs/design.md, "The HTTP front door").

:mod:`.requests` (bodies -> ``GenerateRequest``), :mod:`.front` (the router's request path),
:mod:`.responses`, :mod:`.errors`, :mod:`.transport`, :mod:`.app` (Starlette), :mod:`.server`
(uvicorn in the router's loop), :mod:`.settings` (flags; imports nothing heavy).
"""
