"""thinkahead.orchestrator: see ../shared/DESIGN.md; built in later issues."""
