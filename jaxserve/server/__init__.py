"""The HTTP server: an OpenAI-compatible API over one ``EngineClient``.

``app.py`` assembles the Starlette app from the rooms below it: ``api/`` (the wire format and
the plain routes), ``chat/`` (the chat route, its messages, tools and output parsers),
``guard/`` (what a client may send and ask for) and ``launch/`` (``jaxserve serve``, the one
place that builds an engine and loads JAX). What every route shares sits at this level:
``ServingContext`` (``context.py``), ``Generation``, ``ServerState`` (``lifecycle.py``),
``ServerSettings``, metrics and the request log.
"""
