"""What a client may send and ask for, checked before anything reaches the engine: the API key,
header and body limits (size, time, slow readers), per-client rate limits and per-request cost
limits. Each refusal is an ``APIError`` in OpenAI's shape.
"""
