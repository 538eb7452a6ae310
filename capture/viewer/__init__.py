"""The trajectory viewer: its data, pure (``data`` gathers ``sources``, ``session_list``,
``run``, ``tree``, ``tokens``, ``diff``), served over HTTP (``http``: live from a running proxy,
or offline over OUT) with the page in ``ui/``.

May import: ``capture.ports`` (``GatewayCore``), ``capture.storage``, ``rewriter`` (the tokenizer
and the output parsers). Never ``capture.gateway``."""
