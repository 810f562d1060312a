"""The gateway role: OpenAI-compatible HTTP API, public gRPC API, auth, validation, tokenization.

Stateless: every request is authenticated, validated and tokenized here, then run by a scheduler
over its `SchedulerService.Generate` stream; committed text streams back to the client.
"""
