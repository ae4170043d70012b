"""Judges, process reward models, routers and answer checkers; arrives with the step-level issue."""
