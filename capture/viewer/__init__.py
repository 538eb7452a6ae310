"""The trajectory viewer: its data, pure (``data``), served over HTTP (``http``: live from a
running proxy, or offline over OUT) with the page in ``ui/``.

May import: ``capture.ports`` (``GatewayCore``), ``capture.storage``. Never ``capture.gateway``."""
