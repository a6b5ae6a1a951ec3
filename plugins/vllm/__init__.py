"""vLLM for rollouts, and only what vLLM needs: the ``vllm`` backend, an engine in the trainer's
process (:mod:`~grpo_plugins.vllm.colocated`, building it with :mod:`~grpo_plugins.vllm.engine`),
and the ``vllm-server`` backend, vLLM servers addressed by URL (:mod:`~grpo_plugins.vllm.server`)
with the client of one server, which speaks vLLM's routes and checks its answers
(:mod:`~grpo_plugins.vllm.client`, on the engine's :mod:`grpo_core.http`), the ``grpo-run serve``
command that starts one (:mod:`~grpo_plugins.vllm.serve`), the guard that makes the server
require a shared secret (:mod:`~grpo_plugins.vllm.guard`, loaded inside the server) and the
server's worker extension that receives the weights (:mod:`~grpo_plugins.vllm.worker`, loaded
inside the server only: it imports vLLM). What both backends send vLLM is
:mod:`~grpo_plugins.vllm.io`.

What any engine's backend would share is :mod:`grpo_plugins.rollout`'s, engine-neutral: the
policy's weights (``weights``), the weight channel (``channel``), delta and adapter-only pushes
(``delta``, ``adapter``), the pushes to servers (``pushes``: the server backend's base class, on
the client as a ``PushTarget``), servers addressed by URL split and failed over (``servers``),
an engine's answers as a batch (``outputs``) and partial rollouts' prefix continuation
(``partial``).

Imports go one way, from the backends down to the leaves, and vLLM itself is imported only
inside the functions that need it (and by ``worker``)::

    colocated -> engine, io, rollout.{weights, adapter, outputs, partial}
    server -> client, io, rollout.{pushes, servers, delta, outputs, partial}
    client -> rollout.{channel, outputs, servers}    worker -> rollout.{channel, delta, adapter}
    serve -> guard (which imports none)

The plugins are ``colocated``, ``server`` and ``serve``.
"""
