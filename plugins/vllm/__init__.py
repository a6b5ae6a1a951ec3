"""vLLM for rollouts: the ``vllm`` backend, an engine in the trainer's process
(:mod:`~grpo_plugins.vllm.colocated`, building it with :mod:`~grpo_plugins.vllm.engine`), and the
``vllm-server`` backend, vLLM servers addressed by URL (:mod:`~grpo_plugins.vllm.server`, its
weight pushes in :mod:`~grpo_plugins.vllm.pushes`) with the client of one server, which checks its
answers (:mod:`~grpo_plugins.vllm.client`, on the engine's :mod:`grpo_core.http`), the
``grpo-run serve`` command that starts one (:mod:`~grpo_plugins.vllm.serve`), the guard that makes the server
require a shared secret (:mod:`~grpo_plugins.vllm.guard`, loaded inside the server), the server's
worker extension that receives the weights (:mod:`~grpo_plugins.vllm.worker`, loaded inside the
server only: it imports vLLM) and the ``torch.distributed`` channel that carries them
(:mod:`~grpo_plugins.vllm.channel`). What both backends send vLLM and make of its answers is
:mod:`~grpo_plugins.vllm.io`; the delta pushes both can make (only the elements that changed,
checksummed) are :mod:`~grpo_plugins.vllm.delta` (pure torch, a leaf); the adapter-only LoRA pushes
of both backends are :mod:`~grpo_plugins.vllm.adapter`; what both keep of a completion that a
weight update interrupts, and how it continues from its prefix (partial rollouts), is
:mod:`~grpo_plugins.vllm.partial`.

Imports go one way, from the backends down to the leaves, and vLLM itself is imported only
inside the functions that need it (and by ``worker``)::

    colocated -> engine, io, adapter, partial    server -> pushes, client, io, delta, partial    partial -> io
    pushes -> client, delta, adapter    client -> channel, io    worker -> channel, delta, adapter
    channel -> delta (which imports none)
    serve -> guard (which imports none)

(both backends also take the policy's weights from :mod:`grpo_plugins.rollout.weights`). The
plugins are ``colocated``, ``server`` and ``serve``.
"""
