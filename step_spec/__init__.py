"""thinkahead.step_spec: see ../shared/DESIGN.md; built in later issues."""
