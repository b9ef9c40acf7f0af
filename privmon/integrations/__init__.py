"""Adapters that run a :class:`~privmon.PrivacyMonitor` from a training framework's hooks:
:mod:`~privmon.integrations.lightning`, :mod:`~privmon.integrations.transformers`,
:mod:`~privmon.integrations.ignite`, and :mod:`~privmon.integrations.synthesizers` for table
synthesizers' fits; ``import privmon`` imports none of the frameworks."""
