"""OpenAI's Responses API (``/v1/responses``): requests translated to the chat path (the same
template, sampling, structured outputs, tool grammars and output parsers), the response objects
and streamed events the ``openai`` SDK reads, and the in-memory store behind ``GET``,
``previous_response_id``, background responses and their cancelling."""
