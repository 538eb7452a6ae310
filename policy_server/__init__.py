"""Code that runs on the policy server's side, in vLLM's own virtualenv (``.venv-vllm``) or to
start it: the launcher (``launcher``, ``python -m policy_server``), the worker extension vLLM
loads by its dotted path (``worker``), the LoRA prompt-logprobs fix it applies
(``lora_logits``), and the vLLM version these patch (``pin``).

Pinned to one vLLM: ``pin.VLLM_VERSION`` is what ``scripts/setup.sh`` installs. The worker's
patches reach into vLLM's private classes; on another version the launcher and the worker
warn, the patches that find nothing to patch do nothing, and agenttap's weight checks still
catch a wrong result.

May import: ``rewriter.policy_url`` (the launcher: the socket URL and its length limit), the
standard library; inside vLLM's process (``worker``, ``lora_logits``) vLLM and torch, and
nothing of ``rewriter``, ``capture`` or ``addons``. Nothing here imports the proxy, and the
proxy imports nothing here (tests, benches and examples start vLLM through ``launcher``)."""
