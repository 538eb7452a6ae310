"""The HTTP control plane a trainer drives: the routes (``api``), their OpenAPI document
(``openapi``), session bookkeeping (``sessions``: limits, metrics, secrets), Prometheus
``metrics``, where clients reach an instance (``endpoints``), the start-up ``banner``.

May import: ``capture.ports`` (the gateway, seen as ``GatewayCore``), ``capture.storage``,
``capture.rollouts``, ``capture.viewer``, ``capture.options``. Never ``capture.gateway``."""
