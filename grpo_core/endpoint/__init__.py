"""The OpenAI-compatible HTTP server agent programs talk to: starlette routes on a uvicorn server
in a thread of its own, answering ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` and ``/v1/models``. It knows nothing of training: it parses and checks each
request, hands it to a handler the caller gives (the ``agent`` episode driver,
:mod:`grpo_core.train.actor.drivers.agents`, which generates with the policy and records the
tokens) and writes the handler's choices back as OpenAI answers, whole or streamed. It imports
no module of the engine but :mod:`grpo_core.errors` (tests/core/test_layout.py pins it).

- ``server``: the :class:`~grpo_core.endpoint.server.Endpoint`, requests parsed and checked
  (:class:`~grpo_core.endpoint.server.Request`), errors as OpenAI-shaped JSON.
- ``streaming``: the answers as server-sent events (``stream: true``).
- ``responses_api``: ``/v1/responses`` requests as chat requests, and their answers.
- ``toolcalls``: tool calls and reasoning in the policy's text, per model family.
- ``harmony``: gpt-oss's harmony turns, parsed and rendered by the ``openai-harmony`` package.
"""
