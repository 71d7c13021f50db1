"""Glue to other libraries' training loops. Each submodule imports its library itself, so importing comera_fx (or
this package) never imports them: ``from comera_fx.integrations.huggingface import RankAdaptiveCallback``."""
