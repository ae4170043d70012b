"""Built-in workflows (cot, react, refine, vote, pipeline); arrives with the orchestrator issue."""
