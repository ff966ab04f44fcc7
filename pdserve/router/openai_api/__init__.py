"""The router's OpenAI-compatible HTTP API (docs/design.md, "The HTTP front door").

- :mod:`.requests`: request bodies -> ``GenerateRequest`` messages (JSON types only);
- :mod:`.front`: those -> the router's own request path (``GenerationServicer.job``, ``Flow``);
- :mod:`.responses`: OpenAI's response objects and stream chunks;
- :mod:`.errors`: OpenAI's error shape and HTTP statuses;
- :mod:`.transport`: bounded bodies, disconnect-aware responses (a client gone = a cancel);
- :mod:`.app`: the Starlette application; :mod:`.server`: uvicorn in the router's event loop;
- :mod:`.settings`: flags (imports nothing heavy: the router's argument parser uses it).
"""
