"""What is known about an op without running it: specs, contract, provenance, drift."""
