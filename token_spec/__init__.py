"""Token-level speculation: suffix-tree drafting, lossless verification, the draft/verify loop."""
