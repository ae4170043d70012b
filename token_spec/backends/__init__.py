"""Speculation inside other engines: the suffix drafter as an SGLang plugin (the local engine is
thinkahead.models.engine)."""
