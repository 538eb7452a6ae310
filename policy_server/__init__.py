"""Code that runs on the policy server's side, in vLLM's own virtualenv (``.venv-vllm``) or to
start it: the launcher (``launcher``, ``python -m policy_server``), the worker extension vLLM
loads by its dotted path (``worker``), the LoRA prompt-logprobs fix it applies
(``lora_logits``), and the vLLM version these patch (``pin``).

Pinned to one vLLM: ``pin.VLLM_VERSION`` is what ``scripts/setup.sh`` installs. The worker's
patches reach into vLLM's private classes; on another version the launcher and the worker
warn, the patches that find nothing to patch do nothing, and agenttap's weight checks still
catch a wrong result.

Inside vLLM's process (``worker``, ``lora_logits``): vLLM and torch, nothing of ``rewriter``,
``capture`` or ``addons``. The proxy imports nothing here (tests, benches and examples start
vLLM through ``launcher``)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "rewriter.policy_url",  # the launcher: the socket URL and its length limit
)
