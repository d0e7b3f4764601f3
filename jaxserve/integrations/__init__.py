"""Adapters that run jaxserve inside serving frameworks operators already use (Ray Serve): each
builds the same engine and the same OpenAI routes (``jaxserve.server.app``) as ``jaxserve
serve`` does, from the same flags, and hands them to the framework's replicas, routing and
autoscaling. They sit beside the command line, above the server; nothing below imports them."""
