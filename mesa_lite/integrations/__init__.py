"""Integrations with other libraries' layers; each registers its types with ``wrap``."""
