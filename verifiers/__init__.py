"""thinkahead.verifiers: see ../shared/DESIGN.md; built in later issues."""
