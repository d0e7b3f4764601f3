"""The OpenAI-compatible API's wire format and its plain routes: request bodies parsed and
checked (``protocol.py``, ``fields.py``, ``structured_outputs.py``), errors and logprobs in
OpenAI's shapes, the OpenAPI description, and the ``/v1/completions``, ``/tokenize`` and
``/detokenize`` handlers. Chat's own rules live in ``server/chat/``.
"""
