"""Step segmentation and step policies (specreason, arbitrage, reflect); arrives with the step-level issue."""
