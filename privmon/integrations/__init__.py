"""Adapters that run a :class:`~privmon.PrivacyMonitor` from a training framework's hooks:
:mod:`~privmon.integrations.lightning`, :mod:`~privmon.integrations.transformers` and
:mod:`~privmon.integrations.ignite`; ``import privmon`` imports none of the frameworks."""
