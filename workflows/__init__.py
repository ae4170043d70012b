"""thinkahead.workflows: see ../shared/DESIGN.md; built in later issues."""
